"""The NCCL model's view of the vocabulary-parallel passes (``ptdp.schedule.vocab``): a trace stage that
records each collective as an issue on its own communicator (``"vocab"``: the pipeline group) and each
compute's wait for the collectives it consumes (``vocab.waits_for``), exactly where ``VocabStage`` waits.
``nccl_model.check_trace`` completes a collective once every rank of the group has started it."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from ptdp.parallel.pipeline.handlers import ActionHandler, Handler
from ptdp.schedule.actions import Action
from ptdp.schedule.vocab import VOCAB_COLLECTIVES, VOCAB_COMPUTE, end_ranks, waits_for
from ptdp.simulate.nccl.trace import RecordingComm, _TraceStage

VOCAB_COMM = "vocab"


class VocabTraceStage(_TraceStage):
    """``_TraceStage`` plus the vocabulary actions' handlers, as ``VocabStage`` registers them: ``collective``
    posts a barrier, ``vocab`` records a pass after its waits."""

    def __init__(self, rank: int, p: int, v: int, events: list[dict], placement: str, comm: RecordingComm,
                 barriers: int, embeds_last: bool = False) -> None:
        super().__init__(rank, p, v, events, placement)
        self.comm, self.barriers, self.embeds_last = comm, barriers, embeds_last
        first_rank, last_rank, last = end_ranks(p, v, placement)
        chunks = range(v)
        self.first_chunk = next((c for c in chunks if rank == first_rank and self._stage(c) == 0), None)
        self.last_chunk = next((c for c in chunks if rank == last_rank and self._stage(c) == last), None)
        self._posted: dict[tuple[str, int], int] = {}

    def _stage(self, chunk: int) -> int:
        from ptdp.schedule.actions import virtual_stage

        return virtual_stage(self.rank, chunk, self.p, self.placement)

    def _wait(self, action: Action) -> None:
        for key in waits_for(action, self.first_chunk, self.last_chunk, self.barriers, self.embeds_last):
            if key in self._posted:
                self.events.append({"wait": self._posted.pop(key)})

    def handlers(self) -> Mapping[str, ActionHandler]:
        table: dict[str, ActionHandler] = {op: Handler(lambda a, _: self.collective(a)) for op in VOCAB_COLLECTIVES}
        return table | {op: Handler(lambda a, _: self.vocab(a)) for op in VOCAB_COMPUTE}

    def collective(self, action: Action) -> None:
        index = self.comm._issues
        self.comm._issues += 1
        self.events.append({"issue": [{"op": "coll", "peer": None, "msg": [action.op, action.microbatch]}],
                            "comm": VOCAB_COMM})
        self._posted[action.op, action.microbatch] = index

    def vocab(self, action: Action) -> None:
        self._wait(action)
        self.events.append({"compute": [action.op, action.microbatch, action.chunk]})

    def forward(self, chunk: int, microbatch: int, input: Tensor | None) -> Tensor | None:
        self._wait(Action("F", microbatch, chunk))
        return super().forward(chunk, microbatch, input)

    def backward(self, chunk: int, microbatch: int, output_grad: Tensor | None) -> Tensor | None:
        self._wait(Action("B", microbatch, chunk))
        return super().backward(chunk, microbatch, output_grad)

    def backward_input(self, chunk: int, microbatch: int, output_grad: Tensor | None) -> Tensor | None:
        self._wait(Action("I", microbatch, chunk))
        return super().backward_input(chunk, microbatch, output_grad)
