"""Build the gradient reducer(s) and the optimizer that ``--bf16/--fp16``, ``--use-distributed-optimizer``,
``--data-parallel-sharding-strategy`` (ZeRO 1-3), ``--num-distributed-optimizer-instances`` and
``--overlap-grad-reduce`` ask for: one (parameters, group) pair -- two for a MoE model, whose experts
reduce over their own group (``ptdp.parallel.expert.grads``) -- each reduced by the strategy's reducer
(``ptdp.parallel.data.strategy``), and the optimizer over them."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ptdp.config import Config, MixedPrecisionConfig
from ptdp.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler
from ptdp.optim.optimizer import DistributedOptimizer, FP32Optimizer, MegatronOptimizer
from ptdp.parallel.data.buffer import BucketLayout
from ptdp.parallel.data.protocol import GradReducer
from ptdp.parallel.data.reducer import Composite
from ptdp.parallel.data.strategy import DataParallelGroup, GatherPlan, build_reducer
from ptdp.parallel.init import params_dtype
from ptdp.parallel.parallelize import ParallelModel


def grad_dtype(config: Config) -> torch.dtype:
    """fp32 main grads unless fp16 without --accumulate-allreduce-grads-in-fp32 (Megatron's default)."""
    mp = config.precision
    return torch.float16 if mp.fp16 and not mp.accumulate_allreduce_grads_in_fp32 else torch.float32


def grad_scaler(mp: MixedPrecisionConfig) -> ConstantGradScaler | DynamicGradScaler | None:
    if not mp.fp16:
        return None
    if mp.loss_scale is not None:
        return ConstantGradScaler(mp.loss_scale)
    return DynamicGradScaler(mp.initial_loss_scale, mp.min_loss_scale, mp.loss_scale_window, mp.hysteresis)


def setup_optimizer(model: ParallelModel, config: Config, state, shared_embedding: list[nn.Parameter] = ()
                    ) -> tuple[GradReducer, MegatronOptimizer]:
    """Gradient reducer and optimizer for this rank's ``model`` (its parameters already in
    :func:`params_dtype`; those ``model.deferred`` holds are drawn into the buffers here).

    ``state`` is the rank's ``ParallelState``; ``shared_embedding`` the copies of the tied embedding on
    the first and last stage (their own bucket, so that both stages shard them alike). No bucket spans two
    of the model's chunks: ZeRO-3 gathers each chunk's buckets, with the reducer's ``param_sync``, whose
    handlers the executor runs. The buffers and the optimizers read the parameters' placements
    (``model.placements``: bucketing, weight decay, the gradient norm).
    """
    params, chunks, placements = model.params, model.chunks, model.placements
    tr, opt = config.training, config.optimizer
    distributed = opt.sharding != "no_shard"
    main_params = distributed or params_dtype(config) != torch.float32
    layout = BucketLayout(int(tr.grad_bucket_size_mb * 2**20), grad_dtype(config), main_params,
                          {id(p): i for i, chunk in enumerate(chunks) for p in chunk.parameters()},
                          frozenset(id(p) for p in shared_embedding), placements, model.deferred)
    instances = opt.num_distributed_optimizer_instances if distributed else 1
    dense = data_parallel_group(state, instances)
    # ZeRO-3 with one chunk and no pipeline, resharding after the forward: gathered per layer (zero_layers).
    per_layer = opt.reshard_after_forward and state.dims.pp == 1 and len(chunks) == 1
    gather = GatherPlan(opt.reshard_after_forward, tuple(chunks[0].layers.values()) if per_layer else ())
    if state.expert is not None:  # issue 25: expert grads over the expert-DP group
        from ptdp.parallel.expert.grads import expert_data_parallel

        parts, norm_groups = expert_data_parallel(params, state, placements, dense, distributed, instances)
        grads = Composite([build_reducer(opt.sharding, ps, layout, dp, overlap=tr.overlap_grad_reduce)
                           for ps, dp in parts], gather)
    else:
        grads = build_reducer(opt.sharding, params, layout, dense, overlap=tr.overlap_grad_reduce, gather=gather)
        norm_groups = dense_norm_groups(state, distributed, dense)
    model.deferred.materialize_rest()  # parameters no bucket took (ptdp.parallel.init.defer_init)
    if not main_params:
        return grads, FP32Optimizer(params, config.optimizer, state.tp_rank, norm_groups, placements)
    return grads, DistributedOptimizer(grads, config.optimizer, state.tp_rank, norm_groups,
                                       grad_scaler(config.precision), placements)


def data_parallel_group(state, instances: int) -> DataParallelGroup:
    """Megatron's dp-cp group (parameters are replicated over CP too: ptdp/parallel/dims.py; the plain DP
    group when c = 1), or, for ``instances`` > 1, hybrid sharding's (ptdp/parallel/data/hybrid.py)."""
    if instances == 1:
        return DataParallelGroup(state.dp_cp_group)
    from ptdp.parallel.data.hybrid import instance_groups

    return DataParallelGroup(*instance_groups(state, instances))


def dense_norm_groups(state, distributed: bool, dense: DataParallelGroup) -> list:
    """The groups the squared norm is summed over: TP and PP while DP replicas hold equal grads; sharded,
    every DP rank holds different elements, so the whole world (TP, PP and one instance's shards under
    hybrid sharding: the other instances hold the same shards)."""
    if not (distributed and state.dims.dp * state.dims.cp > 1):
        return [state.tp_group, state.pp_group]
    if dense.replicas is not None:
        return [state.tp_group, state.pp_group, dense.group]
    return [dist.group.WORLD]
