"""What every gradient reducer offers: the one interface the step's assembly (``ptdp.parallel.assembly``),
ZeRO-3's gatherer, the vocabulary passes, checkpoints and memory accounting use (the optimizers: its narrow
part :class:`ShardedGrads`), whatever
the strategy (``--data-parallel-sharding-strategy``), with or without hybrid sharding, and for a MoE
model's dense and expert parameters reduced over different groups.

One iteration: :meth:`GradReducer.start_iteration` (zero the gradients, arm the hooks), the backward (each
parameter's post-accumulate hook calls :meth:`GradReducer.grad_ready`; a bucket whose every parameter has
received its last microbatch's gradient may be launched there), :meth:`GradReducer.launch_chunk` where
ZeRO-3's REDUCE_GRADS action says a chunk's gradients are complete, :meth:`GradReducer.finish_grad_sync`
(launch the rest, wait for all: the first of the assembly's post-backward gradient syncs), the other syncs,
then the optimizer: :meth:`GradReducer.keep_grad_shards`, its step on each bucket's ``own_grad``/``own_param``
(its shard, ``Bucket.shard_start:shard_end`` of a bucket sharded over :meth:`GradReducer.group_of` in
``Bucket.shards`` pieces), and :meth:`GradReducer.all_gather_params`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch.distributed as dist
from torch import nn

from ptdp.parallel.data.buffer import Bucket
from ptdp.parallel.pipeline.handlers import ActionHandler


class ParamSync(Protocol):
    """ZeRO-3's gatherer (``ptdp.parallel.data.zero.ChunkParamSync``): per model chunk, what the
    GATHER_PARAMS / WAIT_PARAMS / RELEASE_PARAMS / REDUCE_GRADS actions do, which
    ``ptdp.schedule.param_sync.add_param_sync`` places in the rank's action list (``reshard_after_forward``:
    how it places them) and whose executor handlers :meth:`handlers` returns."""

    reshard_after_forward: bool

    def gather(self, chunk: int) -> None:
        """Start the all-gather of ``chunk``'s parameters (a prefetch)."""

    def wait(self, chunk: int) -> None:
        """Block until ``chunk``'s parameters are whole."""

    def release(self, chunk: int) -> None:
        """Free ``chunk``'s gathered parameters (the shards stay)."""

    def reduce_grads(self, chunk: int) -> None:
        """Start the reduction of ``chunk``'s gradients (its last gradient-producing action is done)."""

    def handlers(self) -> Mapping[str, ActionHandler]:
        """The executor's handlers of the four actions (``ptdp.parallel.data.zero.param_sync_handlers``)."""


class ShardedGrads(Protocol):
    """What the optimizer (``ptdp.optim``) reads of the data-parallel gradients: the buckets and this rank's
    shard of each (``Bucket.shard_start:shard_end``, over :meth:`group_of`), the two calls around its step,
    and nothing of an iteration (the step's assembly drives those: ``ptdp.parallel.assembly``)."""

    buckets: list[Bucket]
    frozen_buckets: list[Bucket]  # ZeRO-3's shards of weights that do not train (LoRA's base): gathered only

    def keep_grad_shards(self) -> None:
        """ZeRO-2/3: keep only this rank's reduced shards (every later sync of the step is done)."""

    def all_gather_params(self) -> None:
        """After the optimizer step: every rank's updated shard to every rank (parameters not sharded
        between steps; ZeRO-3's are gathered per chunk by ``GradReducer.param_sync``)."""

    def group_of(self, bucket: Bucket) -> dist.ProcessGroup | None:
        """The group ``bucket`` is reduced and sharded over."""


class GradReducer(ShardedGrads, Protocol):
    """The data-parallel gradient synchronisation of a set of parameters (see the module docstring)."""

    params: list[nn.Parameter]
    param_sync: ParamSync | None  # ZeRO-3 with sharded parameters: the per-chunk gatherer; else None

    def start_iteration(self, num_microbatches: int) -> None:
        """Zero the gradients; a bucket may be reduced once each parameter had ``num_microbatches`` backwards."""

    def grad_ready(self, param: nn.Parameter) -> None:
        """The backward hook: ``param`` received one microbatch's gradient."""

    def allocate_main_grad(self, param: nn.Parameter) -> None:
        """Before a gradient is added into ``param.main_grad`` outside autograd (the vocabulary passes): a
        transient bucket gets its buffer first."""

    def launch_chunk(self, chunk: int) -> None:
        """Start the reduction of model chunk ``chunk``'s buckets (its gradients are complete)."""

    def finish_grad_sync(self) -> None:
        """Launch every bucket not launched yet and wait for all: ``main_grad`` (this rank's shard of it,
        when sharded) holds the data-parallel average."""

    def gather_bucket(self, bucket: Bucket) -> list[dist.Work]:
        """Start the all-gather of ``bucket``'s parameters from its shards; the works to wait for."""

    def launched(self) -> list[bool]:
        """Per bucket, whether its reduction is in flight or done (tests check the overlap with it)."""
