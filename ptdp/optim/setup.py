"""Build the gradient buffers and the optimizer that ``--bf16/--fp16``, ``--use-distributed-optimizer``,
``--data-parallel-sharding-strategy`` (ZeRO 1-3), ``--num-distributed-optimizer-instances`` and
``--overlap-grad-reduce`` ask for."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ptdp.config import Config, MixedPrecisionConfig
from ptdp.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler
from ptdp.optim.optimizer import DistributedOptimizer, FP32Optimizer, MegatronOptimizer
from ptdp.parallel.data.buffer import GradBuckets
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
                    ) -> tuple[GradBuckets, MegatronOptimizer]:
    """Gradient buffers and optimizer for this rank's ``model`` (its parameters already in
    :func:`params_dtype`; those ``model.deferred`` holds are drawn into the buffers here).

    ``state`` is the rank's ``ParallelState``; ``shared_embedding`` the copies of the tied embedding on
    the first and last stage (their own bucket, so that both stages shard them alike). ZeRO-3 gathers each
    chunk's buckets: no bucket spans two chunks. Under ZeRO-3 the returned ``GradBuckets`` carries
    ``param_sync``, the per-chunk gatherer the executor drives. The buffers and the optimizers read the
    parameters' placements (``model.placements``: bucketing, weight decay, the gradient norm).
    """
    params, chunks, placements = model.params, model.chunks, model.placements
    tr, opt = config.training, config.optimizer
    strategy = opt.sharding
    distributed = strategy != "no_shard"
    main_params = distributed or params_dtype(config) != torch.float32
    # Over Megatron's dp-cp group: parameters are replicated over CP too (ptdp/parallel/dims.py); it is the
    # plain DP group when c = 1. Hybrid sharding splits it into K instances (ptdp/parallel/data/hybrid.py).
    dp_group, replica_group = state.dp_cp_group, None
    if distributed and opt.num_distributed_optimizer_instances > 1:
        from ptdp.parallel.data.hybrid import instance_groups

        dp_group, replica_group = instance_groups(state, opt.num_distributed_optimizer_instances)
    chunk_of = {id(p): i for i, chunk in enumerate(chunks) for p in chunk.parameters()}
    shard_grads = strategy in ("optim_grads", "optim_grads_params")

    def make(ps, group, average_over=None, separate=(), replica_group=replica_group):
        return GradBuckets(ps, group, int(tr.grad_bucket_size_mb * 2**20), grad_dtype=grad_dtype(config),
                           distributed_optimizer=distributed, param_buffer=main_params,
                           overlap_grad_reduce=tr.overlap_grad_reduce, separate=separate, average_over=average_over,
                           shard_grads=shard_grads, chunk_of=chunk_of, replica_group=replica_group,
                           shard_params=strategy == "optim_grads_params" and state.expert is None,
                           placements=placements, deferred=model.deferred)

    experts = state.expert is not None  # issue 25: expert grads over the expert-DP group
    if experts:
        from ptdp.parallel.expert.grads import expert_grad_buckets

        grads, norm_groups = expert_grad_buckets(params, state, make, list(shared_embedding), distributed,
                                                 placements, (dp_group, replica_group),
                                                 opt.num_distributed_optimizer_instances)
    else:
        grads = make(params, dp_group, separate=shared_embedding)
    model.deferred.materialize_rest()  # parameters no bucket took (ptdp.parallel.init.defer_init)
    if strategy == "optim_grads_params":
        from ptdp.parallel.data.zero import ChunkParamSync, shard_model

        if shard_model(grads):
            grads.param_sync = ChunkParamSync(grads, opt.reshard_after_forward)
            if opt.reshard_after_forward and state.dims.pp == 1 and len(chunks) == 1:  # one chunk: per layer
                from ptdp.parallel.data.zero_layers import LayerParamSync

                grads.param_sync = LayerParamSync(grads, list(getattr(chunks[0], "layers", {}).values()))
    if experts:
        if not main_params:
            return grads, FP32Optimizer(params, config.optimizer, state.tp_rank, norm_groups, placements)
        return grads, DistributedOptimizer(grads, config.optimizer, state.tp_rank, norm_groups,
                                           grad_scaler(config.precision), placements)
    if not main_params:
        return grads, FP32Optimizer(params, config.optimizer, state.tp_rank, [state.tp_group, state.pp_group],
                                    placements)
    # Sharded: every DP rank holds different elements, so the norm is summed over the whole world (over
    # TP, PP and one instance's shards under hybrid sharding: the other instances hold the same shards).
    sharded = distributed and state.dims.dp * state.dims.cp > 1
    norm_groups = [dist.group.WORLD] if sharded else [state.tp_group, state.pp_group]
    if sharded and replica_group is not None:
        norm_groups = [state.tp_group, state.pp_group, dp_group]
    return grads, DistributedOptimizer(grads, config.optimizer, state.tp_rank, norm_groups,
                                       grad_scaler(config.precision), placements)
