"""Gradient buffers of a MoE model: expert parameters reduce over the expert-data-parallel group.

An expert's weights live on the edp ranks of its expert-data-parallel group (``ptdp.parallel.expert.dims``),
not on attention's d·c data replicas, and each copy's gradient already sums the tokens its e expert-parallel
peers sent it (the dispatcher's backward). Summed over the edp group the gradient therefore covers every
token of the pipeline stage once, i.e. the d·c replicas' losses: it is divided by d·c, like the dense
gradients averaged over the dp-cp group. So the expert parameters get their own :class:`GradBuckets` (over
edp, divided by d·c; with the distributed optimizer sharded over edp) and :class:`ExpertGradBuckets` runs
both as one.

The gradient norm is then summed over the whole world, each element counted on exactly one rank (the
placement's ``norm_owner``, read by ``Placement.counts_in_norm``): a dense element on data-parallel
rank 0 (unless the distributed optimizer shards it: each shard then counts) by the tensor-parallel rule, an
expert element on expert-data-parallel rank 0 (or its shard's owner): expert-parallel ranks hold different
experts, so each is counted once across e. Under hybrid sharding (``--num-distributed-optimizer-instances
K``) both groups are cut into K instances (``ptdp.parallel.data.hybrid``) that hold the same shards: only the first
instance's count.

ZeRO-2/3 need nothing else: each :class:`GradBuckets` shards its buckets over its own group, and ZeRO-3's
per-chunk gatherer (``ptdp.parallel.data.zero.ChunkParamSync``) sees one object whose ``buckets`` are both lists,
whose :meth:`ExpertGradBuckets.gather_bucket` hands a bucket to the :class:`GradBuckets` (and group) that
owns it and whose :meth:`ExpertGradBuckets.launch_chunk` reduces the dense buckets, then the expert ones.
Every member of a group runs the same action list (the edp group lies within one pipeline stage), so the
collectives on each group come in the same order everywhere (checked: ``ptdp.simulate.nccl.experts``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import nn

from ptdp.parallel.collectives import group_rank
from ptdp.parallel.data.buffer import Bucket, GradBuckets
from ptdp.parallel.placement import Placements


class ExpertGradBuckets:
    """The dense and the expert :class:`GradBuckets` behind the one interface the trainer and the
    optimizer use (``buckets`` lists both; an expert bucket carries its own ``group`` and ``shard_count``)."""

    def __init__(self, dense: GradBuckets, expert: GradBuckets):
        self.dense, self.expert = dense, expert
        for bucket in expert.buckets:
            bucket.group, bucket.shard_count = expert.dp_group, expert.shard_count
        self.dp_group, self.dp_size, self.shard_count = dense.dp_group, dense.dp_size, dense.shard_count
        self.distributed_optimizer = dense.distributed_optimizer
        self.shard_grads = dense.shard_grads or expert.shard_grads
        self.param_sync = None  # ZeRO-3: the per-chunk gatherer over both (ptdp.optim.setup)
        self._expert_ids = {id(b) for b in expert.buckets}
        self._expert_params = {id(p) for p in expert.params}

    @property
    def parts(self) -> list[GradBuckets]:
        """The dense and the expert buffers (``ptdp.parallel.data.zero.shard_model`` shards each over its group)."""
        return [self.dense, self.expert]

    @property
    def buckets(self) -> list[Bucket]:
        return self.dense.buckets + self.expert.buckets

    @property
    def buffers(self):
        return self.dense.buffers + self.expert.buffers

    @property
    def params(self) -> list[nn.Parameter]:
        return self.dense.params + self.expert.params

    def start_iteration(self, num_microbatches: int) -> None:
        self.dense.start_iteration(num_microbatches)
        self.expert.start_iteration(num_microbatches)

    def zero(self) -> None:
        self.dense.zero()
        self.expert.zero()

    def finish_grad_sync(self) -> None:
        self.dense.finish_grad_sync()
        self.expert.finish_grad_sync()

    all_reduce = finish_grad_sync

    def all_gather_params(self) -> None:
        self.dense.all_gather_params()
        self.expert.all_gather_params()

    def keep_grad_shards(self) -> None:
        self.dense.keep_grad_shards()
        self.expert.keep_grad_shards()

    def allocate_main_grad(self, param: nn.Parameter) -> None:
        """:meth:`GradBuckets.allocate_main_grad` of the buffer that holds ``param``."""
        (self.expert if id(param) in self._expert_params else self.dense).allocate_main_grad(param)

    def gather_bucket(self, b: Bucket) -> list:
        """ZeRO-3: start the all-gather of ``b``'s parameters over the group it is sharded on."""
        return (self.expert if id(b) in self._expert_ids else self.dense).gather_bucket(b)

    def launch_chunk(self, chunk: int) -> None:
        self.dense.launch_chunk(chunk)
        self.expert.launch_chunk(chunk)

    def launched(self) -> list[bool]:
        return self.dense.launched() + self.expert.launched()


def expert_grad_buckets(params: list[nn.Parameter], state, make: Callable[..., GradBuckets],
                        shared_embedding: list[nn.Parameter], distributed: bool, placements: Placements,
                        dense_groups: tuple = (None, None), instances: int = 1) -> tuple[ExpertGradBuckets, list]:
    """The buckets of a MoE model and the norm's groups (the world). ``make(params, group, average_over=,
    separate=, replica_group=)`` builds one :class:`GradBuckets` with the run's settings; ``state`` is the
    ``ParallelState``; ``dense_groups`` the (shard, replica) groups of the dense parameters (the dp-cp group
    and None, or hybrid sharding's instance and replica groups for ``instances`` > 1). Records in
    ``placements`` which rank counts each parameter in the norm (module docstring)."""
    expert = state.expert
    is_expert = [placements.has_role(p, "expert") for p in params]
    dense_params = [p for p, e in zip(params, is_expert, strict=True) if not e]
    expert_params = [p for p, e in zip(params, is_expert, strict=True) if e]
    replicas = state.dims.dp * state.dims.cp
    dense_group, dense_replicas = dense_groups
    if dense_group is None:
        dense_group = state.dp_cp_group
    expert_group, expert_replicas = expert.edp_group, None
    if distributed and instances > 1:  # the expert-DP group cut into K instances too (Megatron does the same)
        from ptdp.parallel.data.hybrid import expert_instance_groups

        expert_group, expert_replicas = expert_instance_groups(expert, state.rank, instances)
    dense = make(dense_params, dense_group, separate=shared_embedding, replica_group=dense_replicas)
    experts = make(expert_params, expert_group, average_over=replicas, replica_group=expert_replicas)
    dense_sharded = distributed and replicas > 1
    expert_sharded = distributed and expert.dims.edp > 1
    for p in dense_params:
        placements.update(p, norm_owner=placements.counts_in_norm(p, state.tp_rank) and (
            _first_instance(dense_replicas) if dense_sharded else (state.dp_rank == 0 and state.cp_rank == 0)))
    for p in expert_params:
        placements.update(p, norm_owner=_first_instance(expert_replicas) if expert_sharded else expert.edp_rank == 0)
    return ExpertGradBuckets(dense, experts), [dist.group.WORLD if state.dims.world_size > 1 else None]


def _first_instance(replica_group) -> bool:
    """Whether this rank's shards count in the norm: every shard of the first hybrid instance (all of them
    without hybrid sharding); the other instances hold copies."""
    return group_rank(replica_group) == 0
