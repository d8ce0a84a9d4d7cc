"""What every gradient reducer offers: the one interface the step, the optimizers, ZeRO-3's gatherer,
checkpoints and memory accounting use, whatever the strategy (``--data-parallel-sharding-strategy``), with
or without hybrid sharding, and for a MoE model's dense and expert parameters reduced over different groups.

One iteration: :meth:`GradReducer.start_iteration` (zero the gradients, arm the hooks), the backward (each
parameter's post-accumulate hook calls :meth:`GradReducer.grad_ready`; a bucket whose every parameter has
received its last microbatch's gradient may be launched there), :meth:`GradReducer.launch_chunk` where
ZeRO-3's plan says a chunk's gradients are complete, :meth:`GradReducer.finish_grad_sync` (launch the rest,
wait for all), the other post-backward syncs, then the optimizer: :meth:`GradReducer.keep_grad_shards`,
its step on each bucket's ``own_grad``/``own_param`` (its shard, ``Bucket.shard_start:shard_end`` of a
bucket sharded over :meth:`GradReducer.group_of` in ``Bucket.shards`` pieces), and
:meth:`GradReducer.all_gather_params`.
"""

from __future__ import annotations

from typing import Protocol

import torch.distributed as dist
from torch import nn

from ptdp.parallel.data.buffer import Bucket


class ParamSync(Protocol):
    """ZeRO-3's gatherer (``ptdp.parallel.data.zero.ChunkParamSync``): the operations the pipeline executor
    runs per model chunk, at the points ``ptdp.parallel.data.param_sync.plan_param_sync`` reads off the
    rank's action list."""

    reshard_after_forward: bool

    def gather(self, chunk: int) -> None: ...

    def wait(self, chunk: int) -> None: ...

    def release(self, chunk: int) -> None: ...

    def reduce_grads(self, chunk: int) -> None: ...


class GradReducer(Protocol):
    """The data-parallel gradient synchronisation of a set of parameters (see the module docstring)."""

    buckets: list[Bucket]
    params: list[nn.Parameter]
    param_sync: ParamSync | None  # ZeRO-3 with sharded parameters: the per-chunk gatherer; else None

    def start_iteration(self, num_microbatches: int) -> None:
        """Zero the gradients; a bucket may be reduced once each parameter had ``num_microbatches`` backwards."""

    def grad_ready(self, param: nn.Parameter) -> None:
        """The backward hook: ``param`` received one microbatch's gradient."""

    def launch_chunk(self, chunk: int) -> None:
        """Start the reduction of model chunk ``chunk``'s buckets (its gradients are complete)."""

    def finish_grad_sync(self) -> None:
        """Launch every bucket not launched yet and wait for all: ``main_grad`` (this rank's shard of it,
        when sharded) holds the data-parallel average."""

    def keep_grad_shards(self) -> None:
        """ZeRO-2/3: keep only this rank's reduced shards (every later sync of the step is done)."""

    def all_gather_params(self) -> None:
        """After the optimizer step: every rank's updated shard to every rank (parameters not sharded
        between steps; ZeRO-3's are gathered per chunk by :attr:`param_sync`)."""

    def gather_bucket(self, bucket: Bucket) -> list[dist.Work]:
        """Start the all-gather of ``bucket``'s parameters from its shards; the works to wait for."""

    def group_of(self, bucket: Bucket) -> dist.ProcessGroup | None:
        """The group ``bucket`` is reduced and sharded over."""

    def launched(self) -> list[bool]:
        """Per bucket, whether its reduction is in flight or done (tests check the overlap with it)."""
