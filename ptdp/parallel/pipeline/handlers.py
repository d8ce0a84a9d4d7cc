"""How an action the executor does not know is run: a handler registered for its op.

The executor (``ptdp.parallel.pipeline.executor.run_schedule``) runs F/B/I/W through the stage and batches
SEND/RECV through ``P2PComm``; every other op of a list -- ZeRO-3's parameter gathers
(``ptdp.parallel.data.zero``), the vocabulary passes and their collectives (``ptdp.parallel.vocab.stage``),
whatever a new schedule adds -- is looked up in a ``Mapping[str, ActionHandler]`` and called with the
action and the running schedule. Adding an action kind: a schedule (``ptdp.schedule``) places actions with
a new op in the lists; the plug-in that owns them registers a handler for that op (from its stage's
``handlers()``, or in the handlers the assembly hands to ``run_schedule``); the NCCL model records what the
handler communicates. An op without a handler stops the run before anything starts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from ptdp.schedule.actions import Action

COMPUTE, COMMUNICATION = "compute", "p2p"  # timeline categories: busy time, and time waiting on communication


class ScheduleContext(Protocol):
    """What a handler may use of the run it is part of: the stage, and the tensors between stages."""

    @property
    def stage(self):  # the PipelineStage being run
        ...

    def receive(self, kind: str, microbatch: int, chunk: int) -> Tensor | None:
        """The activation (``kind`` "F") or gradient ("B") for ``chunk``'s ``microbatch``, waited for if it
        was received by a SEND/RECV batch, handed over locally otherwise; None at either end of the pipeline."""
        ...

    def deliver(self, kind: str, microbatch: int, chunk: int, tensor: Tensor | None) -> None:
        """What ``chunk`` produced for the next (``kind`` "F") or previous ("B") virtual stage: to the
        list's SEND, or straight to the consumer on this rank."""
        ...

    def compute(self, action: Action) -> None:
        """Run an F, B, I or W as the executor does (its receive, span, saved-bytes and in-flight accounting,
        delivery): a handler of a composite action (two microbatches' passes at once) builds on it."""
        ...

    def saving(self, microbatch: int, chunk: int) -> contextlib.AbstractContextManager:
        """Counts what autograd saves inside it as ``chunk``'s activations of ``microbatch``."""
        ...

    def timed(self, name: str, microbatch: int, chunk: int) -> contextlib.AbstractContextManager:
        """A compute span of the timeline (busy time) named ``name``."""
        ...

    def computed(self, action: Action) -> None:
        """The executor's accounting after an F, B, I or W ran outside ``compute`` (activations in flight,
        saved bytes freed): a composite action's handler calls it for each part."""
        ...


class ActionHandler(Protocol):
    """Runs the actions of one op. ``span``: the timeline name of the time it takes (None: not timed);
    ``category``: ``COMPUTE`` (busy) or ``COMMUNICATION`` (waiting: counted as the bubble's idle time)."""

    span: str | None
    category: str

    def __call__(self, action: Action, schedule: ScheduleContext) -> None: ...


@dataclass(frozen=True)
class Handler:
    """An :class:`ActionHandler` from a function of ``(action, schedule)``."""

    run: Callable[[Action, ScheduleContext], None]
    span: str | None = None
    category: str = COMPUTE

    def __call__(self, action: Action, schedule: ScheduleContext) -> None:
        self.run(action, schedule)


def merge_handlers(*tables: Mapping[str, ActionHandler]) -> dict[str, ActionHandler]:
    """One table from several plug-ins'; two registering the same op is a set-up error."""
    merged: dict[str, ActionHandler] = {}
    for table in tables:
        clash = sorted(merged.keys() & table.keys())
        if clash:
            raise ValueError(f"two handlers registered for the action op(s) {clash}")
        merged.update(table)
    return merged
