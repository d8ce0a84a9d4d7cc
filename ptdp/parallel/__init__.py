"""Parallelism applied to a plain model from outside, one folder (or module) per parallelism.

``dims``: sizes, coordinates and the process groups (``ParallelDims``, ``ParallelState``); ``plan``: the
resolved plan the assembly boundary passes down; ``placement``: one record per parameter; ``tensor``,
``sequence``, ``context``, ``expert``, ``vocab``, ``data`` (ZeRO), ``pipeline``, ``recompute``, ``fp8``: the
parallelisms; ``init``: materialising a model built on the meta device with the values one process would
draw. ``parallelize`` is the order of application and ``assembly`` what the step runs (docs/architecture.md).
"""

from ptdp.parallel.dims import ParallelDims, ParallelState, init_distributed

__all__ = ["ParallelDims", "ParallelState", "init_distributed"]
