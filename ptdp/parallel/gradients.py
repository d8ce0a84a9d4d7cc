"""The data-parallel gradients of this rank's model, as the plan resolves them: the reducer(s) that
``--use-distributed-optimizer``, ``--data-parallel-sharding-strategy`` (ZeRO 1-3),
``--num-distributed-optimizer-instances`` and ``--overlap-grad-reduce`` ask for, and the groups their
gradients' squared norm is summed over.

One (parameters, group) pair -- two for a MoE model, whose experts reduce over their own group
(``ptdp.parallel.expert.grads``) -- each reduced by the strategy's reducer (``ptdp.parallel.data.strategy``).
The data-parallel side builds them here, from the plan, and owns them: the step's assembly drives them in
an iteration (``ptdp.parallel.assembly.Assembly.start_iteration``, the first gradient sync, ZeRO-3's gather
actions) and the optimizer sees their shards only (``ptdp.parallel.data.protocol.ShardedGrads``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from ptdp.parallel.data.buffer import BucketLayout
from ptdp.parallel.data.protocol import GradReducer
from ptdp.parallel.data.reducer import Composite
from ptdp.parallel.data.strategy import DataParallelGroup, GatherPlan, build_reducer
from ptdp.parallel.dims import ParallelState
from ptdp.parallel.parallelize import ParallelModel
from ptdp.parallel.plan import ParallelPlan


@dataclass(frozen=True)
class DataParallelGradients:
    """The reducer of this rank's gradients and the process groups their squared norm is summed over
    (TP and PP while the data-parallel replicas hold equal gradients; more where they hold shards)."""

    reducer: GradReducer
    norm_groups: list


def build_gradients(model: ParallelModel, plan: ParallelPlan,
                    shared_embedding: list[nn.Parameter] = ()) -> DataParallelGradients:
    """The reducer(s) of this rank's ``model`` (its parameters already in ``plan.dtype``; those
    ``model.deferred`` holds are drawn into the buffers here) with ``plan.zero``'s strategy.

    ``shared_embedding`` are the copies of the tied embedding on the first and last stage (their own bucket,
    so that both stages shard them alike). No bucket spans two of the model's chunks: ZeRO-3 gathers each
    chunk's buckets, with the reducer's ``param_sync``, whose handlers the executor runs. The buffers read
    the parameters' placements (``model.placements``: bucketing).
    """
    params, chunks, placements, zero, g = model.params, model.chunks, model.placements, plan.zero, plan.groups
    layout = BucketLayout(zero.bucket_bytes, plan.grad_dtype, plan.main_params,
                          {id(p): i for i, chunk in enumerate(chunks) for p in chunk.parameters()},
                          frozenset(id(p) for p in shared_embedding), placements, model.deferred)
    dense = data_parallel_group(g, zero.instances)
    # ZeRO-3 with one chunk and no pipeline, resharding after the forward: gathered per layer (zero_layers).
    per_layer = zero.reshard_after_forward and plan.p == 1 and len(chunks) == 1
    gather = GatherPlan(zero.reshard_after_forward, tuple(chunks[0].layers.values()) if per_layer else ())
    if g.expert is not None:  # expert grads over the expert-DP group
        from ptdp.parallel.expert.grads import expert_data_parallel

        parts, norm_groups = expert_data_parallel(params, g, placements, dense, zero.distributed, zero.instances)
        reducer = Composite([build_reducer(zero.sharding, ps, layout, dp, overlap=zero.overlap_grad_reduce)
                             for ps, dp in parts], gather)
    else:
        reducer = build_reducer(zero.sharding, params, layout, dense, overlap=zero.overlap_grad_reduce,
                                gather=gather)
        norm_groups = dense_norm_groups(plan, dense)
    model.deferred.materialize_rest()  # parameters no bucket took (ptdp.parallel.init.defer_init)
    return DataParallelGradients(reducer, norm_groups)


def data_parallel_group(groups: ParallelState, instances: int) -> DataParallelGroup:
    """Megatron's dp-cp group (parameters are replicated over CP too: ptdp/parallel/dims.py; the plain DP
    group when c = 1), or, for ``instances`` > 1, hybrid sharding's (ptdp/parallel/data/hybrid.py)."""
    if instances == 1:
        return DataParallelGroup(groups.dp_cp_group)
    from ptdp.parallel.data.hybrid import instance_groups

    return DataParallelGroup(*instance_groups(groups, instances))


def dense_norm_groups(plan: ParallelPlan, dense: DataParallelGroup) -> list:
    """The groups the squared norm is summed over: TP and PP while DP replicas hold equal grads; sharded,
    every DP rank holds different elements, so the whole world (TP, PP and one instance's shards under
    hybrid sharding: the other instances hold the same shards)."""
    g = plan.groups
    if not (plan.zero.distributed and plan.d * plan.c > 1):
        return [g.tp_group, g.pp_group]
    if dense.replicas is not None:
        return [g.tp_group, g.pp_group, dense.group]
    return [dist.group.WORLD]
