"""Parallelism applied to a plain model from outside, one module per parallelism.

``dims``: sizes, coordinates and every process group (``ParallelDims``, ``ParallelState``); ``tensor``:
tensor + sequence parallelism; ``context``: context parallelism; ``init``: materialising a model built on
the meta device with the values one process would draw. Pipeline splitting is ``ptdp.parallel.pipeline.stage`` and
the order of application is ``ptdp.parallel.parallelize`` (see ``docs/architecture.md``).
"""

from ptdp.parallel.dims import ParallelDims, ParallelState, init_distributed

__all__ = ["ParallelDims", "ParallelState", "init_distributed"]
