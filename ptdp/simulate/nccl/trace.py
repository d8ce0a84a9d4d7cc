"""Recording what the executor asks for, instead of doing it: the transport (``RecordingComm``) and the
stage (``_TraceStage``) that ``nccl_model.record_comm_trace`` and the traces of the other parallelisms
(``nccl_vocab``, ``nccl_experts``, ``nccl_context``, ``nccl_zero``) run the real executor with. The event
format is ``nccl_model``'s (its module docstring)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ptdp.parallel.pipeline.handlers import ActionHandler
from ptdp.schedule.actions import Action, virtual_stage


@dataclass
class _Posted:
    issue: int


@dataclass
class RecordingComm:
    """Stands in for ``P2PComm``: records each batched call and each wait as a trace event."""

    rank: int
    p: int
    events: list[dict] = field(default_factory=list)
    placement: str = "loop"
    per_direction: bool = False  # one communicator per direction, as ``P2PComm(groups=...)`` posts them
    _issues: int = 0
    _send_issues: list[int] = field(default_factory=list)

    def _msg(self, action: Action) -> list:
        stage = virtual_stage(self.rank, action.chunk, self.p, self.placement)
        kind = action.op[-1]
        if action.op.startswith("RECV"):  # the sender's stage: one before (activation) or after (gradient)
            stage = stage - 1 if kind == "F" else stage + 1
        return [kind, action.microbatch, stage]

    def expect(self, actions: Sequence[Action]) -> None:
        """NCCL: nothing is posted ahead of its batch (``P2PComm.expect``)."""

    def issue(self, sends: Sequence[tuple[Action, Tensor]], recvs: Sequence[Action]) -> dict:
        if not self.per_direction:
            return self._issue(sends, recvs, None)
        posted = {}
        for kind in ("F", "B"):  # P2PComm's order: the activations' batch, then the gradients'
            posted |= self._issue([(a, t) for a, t in sends if a.op[-1] == kind],
                                  [a for a in recvs if a.op[-1] == kind], kind)
        return posted

    def _issue(self, sends: Sequence[tuple[Action, Tensor]], recvs: Sequence[Action], comm: str | None) -> dict:
        ops = [{"op": "send", "peer": a.peer, "msg": self._msg(a)} for a, _ in sends]
        ops += [{"op": "recv", "peer": a.peer, "msg": self._msg(a)} for a in recvs]
        if not ops:
            return {}
        index = self._issues
        self._issues += 1
        self.events.append({"issue": ops} if comm is None else {"issue": ops, "comm": comm})
        if sends:
            self._send_issues.append(index)
        return {(a.op[-1], a.microbatch, a.chunk): _Posted(index) for a in recvs}

    def wait(self, pending: _Posted) -> Tensor:
        self.events.append({"wait": pending.issue})
        return torch.zeros(1)

    def wait_sends(self) -> None:
        for index in self._send_issues:
            self.events.append({"wait": index})
        self._send_issues.clear()


class _TraceStage:
    """A pipeline stage that computes nothing and records what the executor asks it to compute."""

    def __init__(self, rank: int, p: int, v: int, events: list[dict], placement: str = "loop") -> None:
        self.rank, self.p, self.v, self.events, self.placement = rank, p, v, events, placement
        self.losses: dict[int, Tensor] = {}

    def parameters(self) -> list[nn.Parameter]:
        return []

    def handlers(self) -> Mapping[str, ActionHandler]:
        return {}

    def _record(self, op: str, chunk: int, microbatch: int) -> int:
        self.events.append({"compute": [op, microbatch, chunk]})
        return virtual_stage(self.rank, chunk, self.p, self.placement)

    def forward(self, chunk: int, microbatch: int, input: Tensor | None) -> Tensor | None:
        last = self._record("F", chunk, microbatch) == self.p * self.v - 1
        return None if last else torch.zeros(1)

    def _backward(self, op: str, chunk: int, microbatch: int) -> Tensor | None:
        return None if self._record(op, chunk, microbatch) == 0 else torch.zeros(1)

    def backward(self, chunk: int, microbatch: int, output_grad: Tensor | None) -> Tensor | None:
        return self._backward("B", chunk, microbatch)

    def backward_input(self, chunk: int, microbatch: int, output_grad: Tensor | None) -> Tensor | None:
        return self._backward("I", chunk, microbatch)

    def backward_weight(self, chunk: int, microbatch: int) -> None:
        self._record("W", chunk, microbatch)

    def forward_backward(self, forward: Action, input: Tensor | None, backward: Action, output_grad: Tensor | None,
                         saving) -> tuple[Tensor | None, Tensor | None]:
        """An overlapped pair: its forward, then its backward (the pipeline's p2p calls are the same; the
        collectives that interleave inside a pair are ``ptdp.simulate.nccl.experts``')."""
        y = self.forward(forward.chunk, forward.microbatch, input)
        run = self.backward if backward.op == "B" else self.backward_input
        return y, run(backward.chunk, backward.microbatch, output_grad)
