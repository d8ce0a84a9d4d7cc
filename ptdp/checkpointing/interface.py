"""What checkpointing needs from a run, as a typed interface: it reads and restores exactly this.

A save writes this rank's model chunks (their parameters under the layout-independent names their
placements record), the
optimizer's state, where the training data stands, and the configuration and layout it was written by;
a load restores the same into a run built from the configuration. Nothing else of the trainer (the
schedule, the point-to-point transport, the metrics) is visible here, so the trainer's shape can change
without checkpointing changing, and a test can save or load with a small object of its own.

``ptdp.train.state.TrainState`` satisfies :class:`Checkpointable` structurally (no inheritance).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from torch import nn

from ptdp.config import Config
from ptdp.optim import MegatronOptimizer
from ptdp.parallel.placement import Placements
from ptdp.parallel.plan import ParallelPlan


@runtime_checkable
class DataPosition(Protocol):
    """Where the training data stands after an iteration (``ptdp/data/train_stream.py``): what ``ptdp.json``
    records beside the tensors, so that a resumed run reads on without repeating or skipping a sample."""

    def consumed_samples(self, iteration: int) -> int:
        """Samples read once ``iteration`` is done."""
        ...

    def state(self, iteration: int) -> dict:
        """The data state (per dataset: identity, weight, samples read) once ``iteration`` is done."""
        ...


@runtime_checkable
class Checkpointable(Protocol):
    """What a checkpoint saves and loads on one rank (``ptdp/checkpointing/state.py``)."""

    @property
    def config(self) -> Config:
        """The run's configuration: the model's shape and architecture (checked on load), ``--save``'s
        options; recorded whole in ``ptdp.json``."""
        ...

    @property
    def plan(self) -> ParallelPlan:
        """The resolved layout (t, p, d, v, c, e, m, the schedule: recorded, and compared on load), the
        vocabulary's divisor, the seed (re-seeding in another layout) and, in ``plan.groups``, this rank's
        coordinates, meshes and device."""
        ...

    @property
    def chunks(self) -> Sequence[nn.Module]:
        """This rank's model chunks (their ``vocab_size`` and parameters)."""
        ...

    @property
    def placements(self) -> Placements:
        """Where each of those parameters lives in the full model (``ptdp/parallel/placement.py``): its
        layout-independent name, its splits (the ``DTensor`` a save hands DCP), the tied copy's role."""
        ...

    @property
    def optimizer(self) -> MegatronOptimizer:
        """Its per-parameter state, master weights, loss scaler and skipped iterations."""
        ...

    @property
    def model_sharded(self) -> bool:
        """Whether the model's weights live only as this rank's ZeRO-3 pieces (saved as those pieces)."""
        ...

    @property
    def data_position(self) -> DataPosition:
        ...
