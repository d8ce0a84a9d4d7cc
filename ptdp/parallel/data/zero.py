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

:class:`ChunkParamSync` registers the executor's handlers for those four actions (:meth:`handlers`);
:func:`shard_parameters` turns ZeRO-1 buckets into ZeRO-3 ones at set-up, and :func:`full_parameters`
gathers everything for code that reads whole parameters outside the schedule (checkpoints).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch

from ptdp.parallel.data.buffer import Bucket, GradBuckets, free_storage
from ptdp.parallel.pipeline.handlers import COMMUNICATION, ActionHandler, Handler
from ptdp.schedule.param_sync import GATHER, REDUCE, RELEASE, WAIT

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@torch.no_grad()
def shard_parameters(grads: GradBuckets) -> None:
    """Keep only this rank's shard of every bucket's parameters (a copy) and free the full buffers (the
    buckets ``GradBuckets(..., shard_params=True)`` sharded as it built them are left as they are)."""
    for b in grads.buckets:
        if b.param_shard is not None:
            continue
        b.param_shard = b.param_data[b.shard_start:b.shard_end].clone()
        free_storage(b.param_data)


def shard_model(grads) -> bool:
    """ZeRO-3 at set-up: shard the buckets of every part of ``grads`` that has data-parallel peers (a MoE
    model's dense and expert buffers, ``ptdp.parallel.expert.grads``, each over its own group); whether any was."""
    parts = [p for p in getattr(grads, "parts", [grads]) if p.dp_size > 1]
    for part in parts:
        shard_parameters(part)
    return bool(parts)


class ParamSync(Protocol):
    """Per-chunk parameter gathering: what the four actions of ``ptdp.schedule.param_sync`` do."""

    def gather(self, chunk: int) -> None: ...

    def wait(self, chunk: int) -> None: ...

    def release(self, chunk: int) -> None: ...

    def reduce_grads(self, chunk: int) -> None: ...


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

    def __init__(self, grads: GradBuckets, reshard_after_forward: bool):
        """``grads``: anything with ``buckets``, ``gather_bucket`` and ``launch_chunk`` (a GradBuckets, or a
        MoE model's ``ExpertGradBuckets``, which hands each bucket to its own group)."""
        self.grads = grads
        self.reshard_after_forward = reshard_after_forward
        self._in_flight: dict[int, list] = {}
        self._gathered: set[int] = set()

    def _buckets(self, chunk: int) -> list[Bucket]:
        return [b for b in self.grads.buckets if b.chunk == chunk and b.param_shard is not None]

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
def keep_parameter_shards(grads: GradBuckets) -> None:
    """Inside :func:`full_parameters`: the (e.g. just loaded) whole parameters become the shards again."""
    for b in grads.buckets:
        if b.param_shard is not None:
            b.param_shard.copy_(b.param_data[b.shard_start:b.shard_end])


@contextlib.contextmanager
def full_parameters(grads: GradBuckets) -> Iterator[None]:
    """Every parameter whole inside the block (ZeRO-3; nothing to do otherwise), e.g. for a checkpoint;
    freed again at its end (call :func:`keep_parameter_shards` inside to keep changes)."""
    buckets = [b for b in grads.buckets if b.param_shard is not None]
    for handle in [h for b in buckets for h in grads.gather_bucket(b)]:
        handle.wait()
    try:
        yield
    finally:
        for b in buckets:
            free_storage(b.param_data)
