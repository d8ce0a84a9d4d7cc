"""Build the gradient reducer(s) and the optimizer that ``--bf16/--fp16``, ``--use-distributed-optimizer``,
``--data-parallel-sharding-strategy`` (ZeRO 1-3), ``--num-distributed-optimizer-instances`` and
``--overlap-grad-reduce`` ask for: one (parameters, group) pair -- two for a MoE model, whose experts
reduce over their own group (``ptdp.parallel.expert.grads``) -- each reduced by the strategy's reducer
(``ptdp.parallel.data.strategy``), and the optimizer over them."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ptdp.config import MixedPrecisionConfig, OptimizerConfig
from ptdp.config.optimizers import optimizer_spec
from ptdp.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler
from ptdp.optim.muon import MuonLayout
from ptdp.optim.muon_exchange import Shards
from ptdp.optim.muon_units import QKVLayout
from ptdp.optim.optimizer import DistributedOptimizer, FP32Optimizer, MegatronOptimizer
from ptdp.parallel import ParallelState
from ptdp.parallel.data.buffer import BucketLayout
from ptdp.parallel.data.protocol import GradReducer
from ptdp.parallel.data.reducer import Composite
from ptdp.parallel.data.strategy import DataParallelGroup, GatherPlan, build_reducer
from ptdp.parallel.parallelize import ParallelModel
from ptdp.parallel.plan import ParallelPlan


def grad_scaler(mp: MixedPrecisionConfig) -> ConstantGradScaler | DynamicGradScaler | None:
    if not mp.fp16:
        return None
    if mp.loss_scale is not None:
        return ConstantGradScaler(mp.loss_scale)
    return DynamicGradScaler(mp.initial_loss_scale, mp.min_loss_scale, mp.loss_scale_window, mp.hysteresis)


def setup_optimizer(model: ParallelModel, plan: ParallelPlan, hyper: OptimizerConfig, precision: MixedPrecisionConfig,
                    shared_embedding: list[nn.Parameter] = ()) -> tuple[GradReducer, MegatronOptimizer]:
    """Gradient reducer and optimizer for this rank's ``model`` (its parameters already in ``plan.dtype``;
    those ``model.deferred`` holds are drawn into the buffers here), with ``plan.zero``'s strategy and
    ``hyper``'s learning-rate, Adam and clipping settings (``precision``: fp16's loss scaler).

    ``shared_embedding`` are the copies of the tied embedding on the first and last stage (their own bucket,
    so that both stages shard them alike). No bucket spans two of the model's chunks: ZeRO-3 gathers each
    chunk's buckets, with the reducer's ``param_sync``, whose handlers the executor runs. The buffers and the
    optimizers read the parameters' placements (``model.placements``: bucketing, weight decay, the gradient
    norm).
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
        grads = Composite([build_reducer(zero.sharding, ps, layout, dp, overlap=zero.overlap_grad_reduce)
                           for ps, dp in parts], gather)
    else:
        grads = build_reducer(zero.sharding, params, layout, dense, overlap=zero.overlap_grad_reduce, gather=gather)
        norm_groups = dense_norm_groups(plan, dense)
    model.deferred.materialize_rest()  # parameters no bucket took (ptdp.parallel.init.defer_init)
    layout = muon_layout(plan, hyper, grads, params)
    if not plan.main_params:
        return grads, FP32Optimizer(params, hyper, g.tp_rank, norm_groups, placements, layout)
    return grads, DistributedOptimizer(grads, hyper, g.tp_rank, norm_groups, grad_scaler(precision), placements,
                                       layout)


def muon_layout(plan: ParallelPlan, hyper: OptimizerConfig, grads: GradReducer,
                params: list[nn.Parameter]) -> MuonLayout | None:
    """Where ``--optimizer muon``'s matrices lie (``ptdp.optim.muon_exchange``): split over the tensor-
    parallel group (experts: the expert-tensor group), sharded as the reducer's buckets are over their
    data-parallel group (``GradReducer.group_of``); grouped-query attention's QKV row order. None for the
    optimizers whose step exchanges no matrices (``OptimizerSpec.exchanges_matrices``)."""
    if not optimizer_spec(hyper.kind).exchanges_matrices:
        return None
    where = {}
    for bucket in grads.buckets:
        group, size = grads.group_of(bucket), bucket.shard_end - bucket.shard_start
        for param, offset in zip(bucket.params, bucket.offsets, strict=True):
            where[param] = (group, Shards(offset, size, bucket.shards))
    m, g = plan.model, plan.groups
    qkv = QKVLayout(m.num_attention_heads // m.query_groups, m.head_dim) if m.group_query_attention else None
    tp_groups = {"dense": g.tp_group}
    if g.expert is not None:
        tp_groups["expert"] = g.expert.etp_group
    return MuonLayout(tuple(p for p in params if p.requires_grad), tp_groups, where.__getitem__, qkv, g.device)


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
