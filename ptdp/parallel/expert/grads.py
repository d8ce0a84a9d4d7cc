"""Gradient synchronisation of a MoE model: expert parameters reduce over the expert-data-parallel group.

An expert's weights live on the edp ranks of its expert-data-parallel group (``ptdp.parallel.expert.dims``),
not on attention's d·c data replicas, and each copy's gradient already sums the tokens its e expert-parallel
peers sent it (the dispatcher's backward). Summed over the edp group the gradient therefore covers every
token of the pipeline stage once, i.e. the d·c replicas' losses: it is divided by d·c, like the dense
gradients averaged over the dp-cp group. So the model's parameters are two (subset, group) pairs --
:func:`expert_data_parallel` -- each reduced by the strategy's reducer over its own group (with the
distributed optimizer sharded over it), and ``ptdp.parallel.data.reducer.Composite`` runs both as one
(ZeRO-3's gatherer over both: each bucket gathered over the group it is sharded on).

The gradient norm is then summed over the whole world, each element counted on exactly one rank (the
placement's ``norm_owner``, recorded here and read by ``Placement.counts_in_norm``): a dense element on data-parallel
rank 0 (unless the distributed optimizer shards it: each shard then counts) by the tensor-parallel rule, an
expert element on expert-data-parallel rank 0 (or its shard's owner): expert-parallel ranks hold different
experts, so each is counted once across e. Under hybrid sharding (``--num-distributed-optimizer-instances
K``) both groups are cut into K instances (``ptdp.parallel.data.hybrid``) that hold the same shards: only the first
instance's count.

Every member of a group runs the same action list (the edp group lies within one pipeline stage), so the
collectives on each group come in the same order everywhere (checked: ``ptdp.simulate.nccl.experts``).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ptdp.parallel.collectives import group_rank
from ptdp.parallel.data.strategy import DataParallelGroup
from ptdp.parallel.placement import Placements

Parts = list[tuple[list[nn.Parameter], DataParallelGroup]]  # (parameters, where they are reduced)


def expert_data_parallel(params: list[nn.Parameter], state, placements: Placements, dense: DataParallelGroup,
                         distributed: bool, instances: int = 1) -> tuple[Parts, list]:
    """The (parameters, group) pairs of a MoE model -- the dense ones over ``dense`` (the dp-cp group, or
    hybrid sharding's instance and replica groups for ``instances`` > 1), the experts over the
    expert-data-parallel group, divided by d·c -- and the norm's groups (the world). ``state`` is the
    ``ParallelState``; ``distributed``: the optimizer shards (each element's norm owner depends on it).
    Records in ``placements`` which rank counts each parameter in the norm (module docstring)."""
    expert = state.expert
    is_expert = [placements.has_role(p, "expert") for p in params]
    dense_params = [p for p, e in zip(params, is_expert, strict=True) if not e]
    expert_params = [p for p, e in zip(params, is_expert, strict=True) if e]
    replicas = state.dims.dp * state.dims.cp
    expert_group, expert_replicas = expert.edp_group, None
    if distributed and instances > 1:  # the expert-DP group cut into K instances too (Megatron does the same)
        from ptdp.parallel.data.hybrid import expert_instance_groups

        expert_group, expert_replicas = expert_instance_groups(expert, state.rank, instances)
    _record_norm_owners(placements, dense_params, expert_params, state, dense.replicas, expert_replicas, distributed)
    parts = [(dense_params, dense), (expert_params, DataParallelGroup(expert_group, expert_replicas, replicas))]
    return parts, [dist.group.WORLD if state.dims.world_size > 1 else None]


def _record_norm_owners(placements: Placements, dense_params: list[nn.Parameter], expert_params: list[nn.Parameter],
                        state, dense_replicas, expert_replicas, distributed: bool) -> None:
    """Which rank counts each element in the world-wide norm (the module docstring)."""
    expert = state.expert
    dense_sharded = distributed and state.dims.dp * state.dims.cp > 1
    expert_sharded = distributed and expert.dims.edp > 1
    for p in dense_params:
        placements.update(p, norm_owner=placements.counts_in_norm(p, state.tp_rank) and (
            _first_instance(dense_replicas) if dense_sharded else (state.dp_rank == 0 and state.cp_rank == 0)))
    for p in expert_params:
        placements.update(p, norm_owner=_first_instance(expert_replicas) if expert_sharded else expert.edp_rank == 0)


def _first_instance(replica_group) -> bool:
    """Whether this rank's shards count in the norm: every shard of the first hybrid instance (all of them
    without hybrid sharding); the other instances hold copies."""
    return group_rank(replica_group) == 0
