"""ZeRO-3 (``--data-parallel-sharding-strategy optim_grads_params``): each rank keeps only its 1/d shard of
every parameter bucket, and a model chunk's parameters are all-gathered for the computations that need them.

Where the gathers, releases and gradient reductions happen is not decided here but in the rank's action
list: ``ptdp.schedule.param_sync.add_param_sync`` inserts GATHER_PARAMS / WAIT_PARAMS / RELEASE_PARAMS /
REDUCE_GRADS actions around the F/B/I/W (and vocabulary) actions of any schedule -- 1F1B, interleaved,
zero-bubble, V -- so one rule serves them all: a chunk is gathered before its first action of a run
(prefetched one action earlier, so the all-gather overlaps the previous computation), released after the
run, and its gradient buckets are reduced right after its LAST gradient-producing action of the step (its
last B or W: zero-bubble W passes need the gathered weights too), overlapping the rest of the schedule. DP
peers run identical action lists, so the collectives on the data-parallel group are issued in the same
order everywhere (``ptdp.simulate.nccl.zero`` checks the same list against the pipeline's p2p and the
other communicators).

:class:`OptimGradsParams` is the strategy's reducer: ZeRO-2's, over a buffer that keeps only this rank's
parameter shards (``Storage.param_shards``: sharded bucket by bucket as the buffer is built, so start-up
never holds a whole chunk either); it gathers a bucket from the shards into a freshly allocated flat
buffer. :class:`ChunkParamSync` runs the four actions (its :meth:`~ChunkParamSync.handlers` are the
executor's), built with the reducer from a ``strategy.GatherPlan`` (or per layer,
``ptdp.parallel.data.zero_layers``); :func:`full_parameters` gathers everything for code that reads whole
parameters outside the schedule (checkpoints).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist

from ptdp.parallel.data.buffer import Bucket, Storage, alloc_storage, free_storage
from ptdp.parallel.data.protocol import GradReducer, ParamSync
from ptdp.parallel.data.reducer import OptimGrads
from ptdp.parallel.pipeline.handlers import COMMUNICATION, ActionHandler, Handler
from ptdp.schedule.param_sync import GATHER, REDUCE, RELEASE, WAIT


class OptimGradsParams(OptimGrads):
    """``optim_grads_params`` (ZeRO-3): ZeRO-2 with parameter shards, gathered per chunk by ``param_sync``."""

    @classmethod
    def storage(cls, group, hybrid: bool) -> Storage:
        return dataclasses.replace(super().storage(group, hybrid), param_shards=True)

    def gather_bucket(self, bucket: Bucket) -> list[dist.Work]:
        """Allocate the full buffer, fill this rank's piece from its persistent shard, start the all-gather.

        The in-place writes keep the buffer's autograd version: a chunk's parameters are saved for its
        backward and gathered again, unchanged, before it (FSDP's reshard-after-forward).
        """
        if bucket.param_shard is None:
            return super().gather_bucket(bucket)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(bucket.param_data):
            alloc_storage(bucket.param_data)
            bucket.param_data[bucket.shard_start:bucket.shard_end].copy_(bucket.param_shard)
            return super().gather_bucket(bucket)


def param_sync_handlers(sync: ParamSync) -> dict[str, ActionHandler]:
    """The executor's handlers of GATHER_PARAMS, WAIT_PARAMS, RELEASE_PARAMS and REDUCE_GRADS, run by
    ``sync`` (the gatherer, or the NCCL model's recording stand-in); the gather and its wait are timed as
    communication."""
    return {
        GATHER: Handler(lambda a, _: sync.gather(a.chunk), "zero_param_gather", COMMUNICATION),
        WAIT: Handler(lambda a, _: sync.wait(a.chunk), "zero_param_wait", COMMUNICATION),
        RELEASE: Handler(lambda a, _: sync.release(a.chunk)),
        REDUCE: Handler(lambda a, _: sync.reduce_grads(a.chunk)),
    }


class ChunkParamSync:
    """Per-chunk gather / wait / release / reduce: the handlers of ZeRO-3's actions (:meth:`handlers`)."""

    def __init__(self, grads: GradReducer, reshard_after_forward: bool):
        """``grads``: the reducer whose buckets with a ``param_shard`` it gathers (through the reducer's
        ``gather_bucket``: a MoE model's composite hands each bucket to the group it is sharded over)."""
        self.grads = grads
        self.reshard_after_forward = reshard_after_forward
        self._in_flight: dict[int, list] = {}
        self._gathered: set[int] = set()

    def _buckets(self, chunk: int) -> list[Bucket]:
        return [b for b in (*self.grads.buckets, *self.grads.frozen_buckets)
                if b.chunk == chunk and b.param_shard is not None]

    def gather(self, chunk: int) -> None:
        """Start the all-gather of ``chunk``'s parameters (asynchronous: a prefetch)."""
        if chunk in self._gathered or chunk in self._in_flight:
            return
        self._in_flight[chunk] = [h for b in self._buckets(chunk) for h in self.grads.gather_bucket(b)]

    def wait(self, chunk: int) -> None:
        """Block until ``chunk``'s parameters are whole (gathering them now if nobody prefetched)."""
        self.gather(chunk)
        for handle in self._in_flight.pop(chunk, []):
            handle.wait()
        self._gathered.add(chunk)

    def release(self, chunk: int) -> None:
        """Free ``chunk``'s gathered parameters (the persistent shards stay)."""
        self.wait(chunk)  # never free a buffer a collective is still writing
        for b in self._buckets(chunk):
            free_storage(b.param_data)
        self._gathered.discard(chunk)

    def reduce_grads(self, chunk: int) -> None:
        """Start the data-parallel reduction of ``chunk``'s gradients (waited for in ``finish_grad_sync``)."""
        self.grads.launch_chunk(chunk)

    def handlers(self) -> dict[str, ActionHandler]:
        return param_sync_handlers(self)


@torch.no_grad()
def keep_parameter_shards(grads: GradReducer) -> None:
    """Inside :func:`full_parameters`: the (e.g. just loaded) whole parameters become the shards again."""
    for b in (*grads.buckets, *grads.frozen_buckets):
        if b.param_shard is not None:
            b.param_shard.copy_(b.param_data[b.shard_start:b.shard_end])


@contextlib.contextmanager
def full_parameters(grads: GradReducer) -> Iterator[None]:
    """Every parameter whole inside the block (ZeRO-3; nothing to do otherwise), e.g. for a checkpoint;
    freed again at its end (call :func:`keep_parameter_shards` inside to keep changes)."""
    buckets = [b for b in (*grads.buckets, *grads.frozen_buckets) if b.param_shard is not None]
    for handle in [h for b in buckets for h in grads.gather_bucket(b)]:
        handle.wait()
    try:
        yield
    finally:
        for b in buckets:
            free_storage(b.param_data)
