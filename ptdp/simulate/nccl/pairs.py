"""The NCCL model's view of a stage run in pieces: two microbatches' expert collectives interleaved on one rank.

In a list with overlapped pairs (DualPipeV, combined 1F1B) the stage runs every forward and backward as
pieces (``ptdp.models.pieces``), and inside a pair it alternates the pieces of one microbatch's forward and
another's backward, each issuing its dispatch and combine asynchronously and waiting for them only where
they are needed. So on one rank the collectives of two microbatches interleave, and what must hold is that
every rank of an expert-parallel group issues them in the same order (docs/references.md, §NCCL).

:func:`chunk_program` mirrors a chunk of ``moe_layers`` MoE layers as the real pipeline cuts it
(``ptdp.parallel.pipeline.program``: the embedding, per layer attention / norm / route / dispatch / experts /
combine / finish / residual, the head), with steps that compute nothing but record, in the order the real engine runs them,
the collectives the real pieces make: synchronous ones inside a piece (the all-to-all of the counts,
expert tensor parallelism's gathers) as trace placeholders waited on at once, the transfers between pieces
as placeholders issued at ``start`` and waited on at ``wait``. Running it through the REAL engine
(``ForwardRun``, ``BackwardRun``, ``interleave``, and ``torch.utils.checkpoint`` for recomputation) gives the
order of issues and waits the executor makes; tests/test_dualpipe_nccl.py checks the mirror against the
real MoE layer's steps. ``ptdp.simulate.nccl.experts`` turns the placeholders into issues over the groups.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ptdp.models.pieces import Compute, Exchange, Step

# (sync collectives of the forward, of the backward) per piece, and the transfers (forward, backward)
ROUTE = {"alltoall": (["dispatch-counts"], []), "allgather": ([], [])}
DISPATCH = {"alltoall": (["dispatch-tokens"], ["dispatch-tokens-grad"]),
            "allgather": (["gather-tokens", "gather-probs", "gather-choices"], ["gather-tokens-grad", "gather-probs-grad"])}
COMBINE = {"alltoall": (["combine-tokens"], ["combine-tokens-grad"]),
           "allgather": (["combine-reduce-scatter"], ["combine-reduce-scatter-grad"])}
ETP_ROUTE = (["etp-gather-tokens", "etp-gather-probs", "etp-gather-choices"], ["etp-gather-probs-grad", "etp-gather-tokens-grad"])
ETP_FINISH = (["etp-reduce-scatter"], ["etp-reduce-scatter-grad"])
# tensor parallelism ("tp"; "sp" with sequence parallelism), on the "tp" communicator: the transfers a half
# of a layer is cut at (the entry of its first linear, the exit of its last: ptdp.parallel.pipeline.program), by the half
TP_ENTRY = {"tp": lambda h: ([], [f"tp-{h}-in-grad"]), "sp": lambda h: ([f"sp-{h}-gather"], [f"sp-{h}-gather-grad"])}
TP_EXIT = {"tp": lambda h: ([f"tp-{h}-out"], []), "sp": lambda h: ([f"sp-{h}-reduce-scatter"], [f"sp-{h}-reduce-scatter-grad"])}
# ... and the synchronous ones inside pieces: the vocabulary-parallel embedding's reduction (and under sequence
# parallelism the scatter's backward gather), the logits' region, the MoE dispatcher's token slicing over the
# tensor-parallel ranks (t > 1 without sequence parallelism, expert tensor parallelism 1)
TP_EMBEDDING = {"tp": (["tp-embedding-reduce"], []), "sp": (["tp-embedding-reduce"], ["sp-embedding-scatter-grad"])}
TP_HEAD = {"tp": ([], ["tp-logits-in-grad"]), "sp": (["sp-logits-gather"], ["sp-logits-gather-grad"])}
TP_TOKENS_ROUTE = {"tp": ([], ["tp-token-split-probs-grad", "tp-token-split-tokens-grad"]), "sp": ([], [])}
TP_TOKENS_FINISH = {"tp": (["tp-token-gather"], []), "sp": ([], [])}
# the vocabulary-parallel cross-entropy's all-reduces, when the last stage's forward leaves its pieces
TP_LOSS = ["tp-loss-max", "tp-loss-target", "tp-loss-sum-exp"]


@dataclass
class Label:
    """Who a placeholder belongs to: the pass (F, or the B/I that backpropagates it), microbatch, stage."""

    op: str
    microbatch: int
    stage: int


@dataclass
class Recorder:
    """Appends the trace placeholders to a rank's events (``ptdp.simulate.nccl.experts._globalise``)."""

    events: list[dict]
    refs: int = field(default=0)

    def sync(self, label: Label, name: str, layer: int, op: str | None = None) -> None:
        comm = _comm(name)
        self.events.append({"collective": [comm, f"{comm} {op or label.op}:{name} layer {layer}",
                                           label.microbatch, label.stage]})

    def start(self, label: Label, names: list[str], layer: int, op: str | None = None) -> list[int]:
        refs = []
        for name in names:
            self.refs += 1
            comm = _comm(name)
            self.events.append({"collective-start": [self.refs, comm, f"{comm} {op or label.op}:{name} layer {layer}",
                                                     label.microbatch, label.stage]})
            refs.append(self.refs)
        return refs

    def wait(self, refs: list[int]) -> None:
        self.events.extend({"collective-wait": ref} for ref in refs)


def _comm(name: str) -> str:
    """The communicator of a placeholder: "etp", "tp" (tensor and sequence parallelism's), else "ep"."""
    head = name.split("-")[0]
    return {"etp": "etp", "tp": "tp", "sp": "tp"}.get(head, "ep")


class _Collectives(torch.autograd.Function):
    """A piece's synchronous collectives: ``forward`` records its forward ones, ``backward`` its backward ones."""

    @staticmethod
    def forward(ctx, x: Tensor, on_forward: Callable[[], None], on_backward: Callable[[], None]) -> Tensor:
        on_forward()
        ctx.on_backward = on_backward
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.on_backward()
        return grad, None, None


@dataclass
class _Waiting:
    recorder: Recorder
    refs: list[int]
    result: tuple

    def wait(self) -> tuple:
        self.recorder.wait(self.refs)
        return self.result


@dataclass
class _Transfer:
    recorder: Recorder
    label: Label
    names: tuple[list[str], list[str]]
    layer: int

    def start(self, tensors: tuple) -> _Waiting:
        refs = self.recorder.start(self.label, self.names[0], self.layer, "F")
        return _Waiting(self.recorder, refs, tuple(t.clone() for t in tensors))

    def start_backward(self, grads: tuple) -> _Waiting:
        return _Waiting(self.recorder, self.recorder.start(self.label, self.names[1], self.layer), grads)


def chunk_program(first: bool, last: bool, moe_layers: int, dispatcher: str, expert_tensor: bool,
                  recompute: bool, recorder: Recorder, label: Label, *, layers: Sequence[bool] | None = None,
                  tensor: str | None = None) -> tuple[list[Step], str]:
    """A chunk's pieces (module docstring), from the value "input" (a one-tensor tuple, as every value here)
    to the returned name. ``label.op`` is "F" while the forward runs; the backward sets its B or I.
    ``layers``: which of the chunk's layers are MoE (default: ``moe_layers`` MoE layers); ``tensor`` ("tp",
    or "sp" with sequence parallelism; None: t = 1): each half of a layer cut at its tensor-parallel
    transfers, as ``ptdp.parallel.pipeline.program`` cuts it, with the synchronous tensor-parallel collectives of
    the embedding, the head and the MoE dispatcher's token slicing."""
    steps: list[Step] = []
    layers = [True] * moe_layers if layers is None else list(layers)
    none: tuple[list[str], list[str]] = ([], [])

    def piece(name: str, layer: int, collectives: tuple[list[str], list[str]] = ([], [])) -> None:
        def record_forward() -> None:
            for c in collectives[0]:
                recorder.sync(label, c, layer, "F")

        def record_backward() -> None:
            for c in collectives[1]:
                recorder.sync(label, c, layer)

        def run(t: tuple) -> tuple[tuple]:
            return ((_Collectives.apply(t[0], record_forward, record_backward),),)

        if recompute and layer >= 0:  # a recomputed layer's pieces are checkpointed (ptdp.parallel.recompute)
            run = functools.partial(checkpoint, run, use_reentrant=False)
        steps.append(Compute(run, (_last(steps),), (f"v{len(steps)}",), name))

    def exchange(name: str, layer: int, names: tuple[list[str], list[str]]) -> None:
        steps.append(Exchange(lambda _: _Transfer(recorder, label, names, layer), _last(steps), f"v{len(steps)}",
                              name))

    def half(what: str, layer: int) -> None:
        if tensor is None:
            piece(what, layer)
            return
        piece(f"{what}_norm", layer)
        exchange(f"{what}_in", layer, TP_ENTRY[tensor](what))
        piece(what, layer)
        exchange(f"{what}_out", layer, TP_EXIT[tensor](what))
        piece(f"{what}_residual", layer)

    if first:
        piece("embedding", -1, TP_EMBEDDING[tensor] if tensor else none)
    etp_route = ETP_ROUTE if expert_tensor else none
    etp_finish = ETP_FINISH if expert_tensor else none
    route = TP_TOKENS_ROUTE[tensor] if tensor else none
    finish = TP_TOKENS_FINISH[tensor] if tensor else none
    for layer, moe in enumerate(layers):
        half("attention", layer)
        if not moe:
            half("mlp", layer)
            continue
        piece("mlp_norm", layer)
        piece("moe_route", layer, (etp_route[0] + ROUTE[dispatcher][0] + route[0],
                                   route[1] + etp_route[1] + ROUTE[dispatcher][1]))
        exchange("moe_dispatch", layer, DISPATCH[dispatcher])
        piece("moe_experts", layer)
        exchange("moe_combine", layer, COMBINE[dispatcher])
        piece("moe_finish", layer, (etp_finish[0] + finish[0], finish[1] + etp_finish[1]))
        piece("mlp_residual", layer)
    if last:
        piece("head", -1, TP_HEAD[tensor] if tensor else none)
    return steps, _last(steps)


def _last(steps: list[Step]) -> str:
    """The name of the value the program so far ends with."""
    if not steps:
        return "input"
    step = steps[-1]
    return step.outputs[0] if isinstance(step, Compute) else step.output
