"""The overlapped forward-and-backward action ("FB"): its executor handler and when a stage runs in pieces.

DualPipeV's steady state and Megatron-Core's combined 1F1B (``--overlap-moe-expert-parallel-comm``) put
one microbatch's forward and another's backward into ONE action of the list (``ptdp.schedule.dualpipe``;
``Action.sub`` holds the two). The executor knows no such op: :class:`OverlapHandler`, registered here
for it (:func:`overlap_handlers`; the assembly and the NCCL model's recorders add it), receives both
inputs, has the stage run the pair (``PipelineStage.forward_backward``: ``ModuleStage`` interleaves the
two microbatches' pieces, ``ptdp.models.pieces``, cut by ``ptdp.parallel.pipeline.program``, each piece's communication in flight while the other's
piece computes), does the executor's accounting for both parts and delivers both results, which the list's
SEND actions after the pair then carry. Pipeline sends overlap compute as everywhere (posted where the
list places them, waited on at the end); the expert dispatch and combine, and at t > 1 each layer's
tensor-parallel collectives (``ptdp.parallel.tensor.transfers``), overlap the other microbatch's pieces.

A stage must run every forward of a list with such pairs in pieces, since any of them may later be
backpropagated inside a pair: :func:`stage_options` says so to the stage factory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ptdp.parallel.pipeline.handlers import COMPUTE, ActionHandler, ScheduleContext
from ptdp.schedule.actions import OVERLAP, Action


@dataclass(frozen=True)
class OverlapHandler:
    """Runs an ``OVERLAP`` action (module docstring). Its time is the pair's compute span
    ("forward_backward"), recorded after both inputs were received (their waits are communication)."""

    span: str | None = None  # timed inside, after the receives
    category: str = COMPUTE

    def __call__(self, action: Action, schedule: ScheduleContext) -> None:
        forward, backward = action.sub
        x = schedule.receive("F", forward.microbatch, forward.chunk)
        g = schedule.receive("B", backward.microbatch, backward.chunk)
        with schedule.timed("forward_backward", forward.microbatch, forward.chunk):
            y, dx = schedule.stage.forward_backward(
                forward, x, backward, g, lambda: schedule.saving(forward.microbatch, forward.chunk))
        schedule.computed(forward)
        schedule.computed(backward)
        schedule.deliver("F", forward.microbatch, forward.chunk, y)
        schedule.deliver("B", backward.microbatch, backward.chunk, dx)


def overlap_handlers() -> dict[str, ActionHandler]:
    """The handler of the overlapped pairs, for ``run_schedule``'s handlers."""
    return {OVERLAP: OverlapHandler()}


def has_pairs(actions: Sequence[Action]) -> bool:
    """Whether a list holds overlapped pairs (then its stage runs every forward in pieces)."""
    return any(a.op == OVERLAP for a in actions)


def stage_options(pairs: bool, delay_weight_grads: bool = False) -> dict[str, bool]:
    """The stage factory's options for a list with (``pairs``) or without overlapped pairs: ``piecewise``
    (and then ``delay_weight_grads``, ``--delay-wgrad-compute``)."""
    return {"piecewise": pairs, "delay_weight_grads": pairs and delay_weight_grads}
