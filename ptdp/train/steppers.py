"""What the loop runs each iteration, as one object: which iterations to train, how to train one, and
what to release at the end (:class:`Stepper`).

The loop is the same for every run; a feature that changes how iterations are taken (a fault-tolerant
replica group's quorum and commit, ``ptdp.train.replicas``) brings its own stepper, chosen here from the
run's options, so that the loop names no feature.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from ptdp.train.state import TrainState
from ptdp.train.step import train_step


class Stepper(Protocol):
    """The iterations of a run and the step of each."""

    def iterations(self, first: int, last: int) -> Iterable[int]:
        """The iterations to train, from ``first`` (the one after the resumed checkpoint) to ``last``; an
        iteration may come again after a :meth:`step` that did not take it."""

    def step(self, trainer: TrainState, iteration: int) -> dict | None:
        """Train ``iteration``: its record (device scalars, read by ``ptdp.train.report.read_records``), or
        None when the iteration was not taken (:meth:`iterations` yields it again)."""

    def close(self) -> None:
        """Release what the stepper holds (called once, however the run ends)."""


class PlainSteps:
    """One ``train_step`` per iteration, each taken: ``first`` to ``last`` in order."""

    def iterations(self, first: int, last: int) -> Iterable[int]:
        return range(first, last + 1)

    def step(self, trainer: TrainState, iteration: int) -> dict:
        return train_step(trainer, iteration)

    def close(self) -> None:
        pass


def build_stepper(trainer: TrainState) -> Stepper:
    """The stepper the run's options ask for: a fault-tolerant replica group's (``--fault-tolerant-replicas``
    R > 1: each iteration after its quorum, a restarted group starting where its peers are) or the plain one."""
    if trainer.config.parallel.fault_tolerant_replicas > 1:
        from ptdp.train.replicas import ReplicaSteps

        return ReplicaSteps(trainer)
    return PlainSteps()
