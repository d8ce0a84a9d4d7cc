"""Build the optimizer that ``--optimizer``, ``--bf16/--fp16`` and ``--use-distributed-optimizer`` ask for,
over the data-parallel gradients the parallel side built (``ptdp.parallel.gradients``): the fp32 one, or the
distributed one over the reducers' shards (``ptdp.parallel.data.protocol.ShardedGrads``, all it reads of
them); Muon's layout of the matrices over those shards; fp16's loss scaler."""

from __future__ import annotations

from torch import nn

from ptdp.config import MixedPrecisionConfig, OptimizerConfig
from ptdp.config.optimizers import optimizer_spec
from ptdp.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler
from ptdp.optim.muon import MuonLayout
from ptdp.optim.muon_exchange import Shards
from ptdp.optim.muon_units import QKVLayout
from ptdp.optim.optimizer import DistributedOptimizer, FP32Optimizer, MegatronOptimizer
from ptdp.parallel.data.protocol import ShardedGrads
from ptdp.parallel.gradients import DataParallelGradients
from ptdp.parallel.parallelize import ParallelModel
from ptdp.parallel.plan import ParallelPlan


def grad_scaler(mp: MixedPrecisionConfig) -> ConstantGradScaler | DynamicGradScaler | None:
    if not mp.fp16:
        return None
    if mp.loss_scale is not None:
        return ConstantGradScaler(mp.loss_scale)
    return DynamicGradScaler(mp.initial_loss_scale, mp.min_loss_scale, mp.loss_scale_window, mp.hysteresis)


def setup_optimizer(model: ParallelModel, plan: ParallelPlan, grads: DataParallelGradients, hyper: OptimizerConfig,
                    precision: MixedPrecisionConfig) -> MegatronOptimizer:
    """The optimizer of this rank's ``model`` over its data-parallel gradients (``grads``, built by
    ``ptdp.parallel.gradients.build_gradients``: the optimizer reads their shards, ``ShardedGrads``, and sums
    the squared norm over their ``norm_groups``), with ``hyper``'s learning-rate, Adam and clipping settings
    (``precision``: fp16's loss scaler). The optimizers read the parameters' placements (``model.placements``:
    weight decay, the gradient norm)."""
    params, placements, g = model.params, model.placements, plan.groups
    layout = muon_layout(plan, hyper, grads.reducer, params)
    if not plan.main_params:
        return FP32Optimizer(params, hyper, g.tp_rank, grads.norm_groups, placements, layout)
    return DistributedOptimizer(grads.reducer, hyper, g.tp_rank, grads.norm_groups, grad_scaler(precision),
                                placements, layout)


def muon_layout(plan: ParallelPlan, hyper: OptimizerConfig, grads: ShardedGrads,
                params: list[nn.Parameter]) -> MuonLayout | None:
    """Where ``--optimizer muon``'s matrices lie (``ptdp.optim.muon_exchange``): split over the tensor-
    parallel group (experts: the expert-tensor group), sharded as the reducer's buckets are over their
    data-parallel group (``ShardedGrads.group_of``); grouped-query attention's QKV row order. None for the
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

