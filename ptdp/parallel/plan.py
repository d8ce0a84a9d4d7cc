"""One resolved plan of a rank's parallel run: every size and decision below the assembly, made once.

``ptdp.train.state.setup`` builds the process groups (:func:`process_groups`, the one place that builds the
run's groups: ``ptdp.parallel.dims``'s and the MoE layers' folded ones), then :func:`resolve_plan` reads the
derived configuration (``ptdp.config.derive``) once and answers every question the parallel layers used to
ask it again: the sizes t, c, p, d, v, m (and the MoE layers' e, etp, edp), whether sequence parallelism is on
(only with t > 1: decided here, read everywhere else), the schedule and how it places virtual stages, the
layer split, the vocabulary barriers, the ZeRO strategy, the dtypes, whether initial values wait for the
flat buffers. The plan is what crosses the assembly boundary -- ``build_model_chunks``, ``assemble``,
``build_p2p``, ``setup_optimizer`` and checkpointing take it -- and what is below the boundary (the apply
steps, the layers, the reducers, the executor) takes plain numbers, flags and groups from it: none of them
imports this module (pyproject.toml places it above them).

Why the groups are a field (``plan.groups``, the rank's ``ParallelState``) rather than an object beside the
plan: every function at the boundary needs both (a size to decide, a group to communicate in), so a pair
would be passed everywhere together, and a plan could meet groups built for other sizes; as a field the
groups are the ones the plan's sizes were resolved from (:func:`resolve_plan` reads t, c, p, d and the
placement from them). The rule that keeps it readable: what every rank of the job agrees on is a field of
the plan (equal on every rank: plans compare without their groups), what is this rank's own -- its rank
and coordinates, its device, its groups and meshes -- is in ``plan.groups``.

The model's description (``model``, ``moe``: the configuration sections as given) rides along, because the
apply steps build the model they split; the plan decides how it is split, not what it is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ptdp.config import Config, LoRAConfig, ModelConfig, MoEConfig, layout
from ptdp.parallel.dims import ParallelDims, ParallelState
from ptdp.parallel.expert.dims import build_expert_parallel
from ptdp.schedule.layout import Stage
from ptdp.schedule.registry import schedule_placement


@dataclass(frozen=True)
class ZeroPlan:
    """The data-parallel gradient synchronisation and the distributed optimizer (``ptdp.parallel.data``)."""

    sharding: str  # no_shard, optim (ZeRO-1), optim_grads (ZeRO-2), optim_grads_params (ZeRO-3): the effective one
    instances: int  # hybrid sharding's K (--num-distributed-optimizer-instances); 1 unless sharded
    overlap_grad_reduce: bool
    reshard_after_forward: bool  # ZeRO-3: free a chunk's gathered parameters after its forwards
    bucket_bytes: int

    @property
    def distributed(self) -> bool:
        """The optimizer state (and more, by the strategy) is sharded over the data-parallel group."""
        return self.sharding != "no_shard"


@dataclass(frozen=True)
class ParallelPlan:
    """This rank's resolved parallel run (module docstring): sizes and decisions, and ``groups``."""

    groups: ParallelState = dataclasses.field(compare=False, repr=False)  # this rank's coordinates and groups
    world: int
    t: int  # tensor parallel
    c: int  # context parallel
    p: int  # pipeline parallel
    d: int  # data parallel
    v: int  # model chunks per pipeline rank
    m: int  # microbatches per pipeline per iteration
    e: int  # expert parallel (MoE layers: the same ranks folded as etp x e x edp x p)
    etp: int  # expert tensor parallel
    edp: int  # expert data parallel
    sequence_parallel: bool  # decided: only with t > 1
    schedule: str  # the registry's name (ptdp.schedule.registry)
    placement: str  # how the schedule places virtual stages on ranks: "loop" or "v"
    stages: tuple[Stage, ...]  # the p x v virtual stages' layers, in pipeline order (even or Megatron's layout)
    vocab_barriers: int  # vocabulary parallelism's barriers per microbatch; 0: off (ptdp.schedule.vocab)
    overlap_moe_expert_parallel_comm: bool  # combined 1F1B's overlapped pairs (ptdp.schedule.dualpipe)
    delay_wgrad_compute: bool  # inside a pair, a piece's weight gradients after its exchange is issued
    cp_comm_type: str  # p2p, a2a or allgather
    linear_cp_comm_type: str  # the Gated DeltaNet layers': state_passing or a2a
    scatter_gather: bool  # the pipeline sends 1/t of each boundary tensor (not under sequence parallelism)
    zero: ZeroPlan
    dtype: torch.dtype  # of the parameters and activations
    grad_dtype: torch.dtype  # of the main gradients
    seed: int
    micro_batch_size: int
    fp8_format: str | None
    fp8_recipe: str
    model: ModelConfig = dataclasses.field(repr=False)
    moe: MoEConfig = dataclasses.field(repr=False)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig, repr=False)  # rank 0: no LoRA

    @property
    def vocab_parallel(self) -> bool:
        """The vocabulary layers split over all p pipeline ranks too."""
        return self.vocab_barriers > 0

    @property
    def vocab_divisor(self) -> int:
        """What the vocabulary is padded to a multiple of (with Megatron's 128): t, or p·t when split by
        vocabulary over the pipeline as well."""
        return self.t * (self.p if self.vocab_parallel else 1)

    @property
    def main_params(self) -> bool:
        """Parameters live in flat buffers with fp32 main weights (ZeRO, or a 16-bit model)."""
        return self.zero.distributed or self.dtype != torch.float32

    @property
    def defer_init(self) -> bool:
        """Initial values are drawn straight into the flat parameter buffers (``ptdp.parallel.init``), except
        where the chunks are read or drawn whole at build time (vocabulary parallelism, ``--compile``)."""
        return self.main_params and not self.vocab_parallel and not self.model.compile

    @property
    def local_seq_length(self) -> int:
        """Tokens of one sample on this rank between layers: s/c, and a further 1/t under sequence
        parallelism."""
        seq = self.model.seq_length // self.c
        return seq // self.t if self.sequence_parallel else seq


def resolve_plan(config: Config, groups: ParallelState) -> ParallelPlan:
    """The plan of ``config`` on the ranks of ``groups`` (built for its sizes). ``config`` is validated and
    derived (``ptdp.config.derive``): its values are the resolved ones, e.g. no sequence parallelism at t = 1."""
    par, opt, tr, mp = config.parallel, config.optimizer, config.training, config.precision
    sizes = layout(config, groups.dims.world_size)
    t, c, p, d = sizes.tensor_model_parallel_size, sizes.context_parallel_size, \
        sizes.pipeline_model_parallel_size, sizes.data_parallel_size
    if (t, c, p, d) != (groups.dims.tp, groups.dims.cp, groups.dims.pp, groups.dims.dp):
        raise ValueError(f"groups built for t={groups.dims.tp} c={groups.dims.cp} p={groups.dims.pp}, "
                         f"the configuration says t={t} c={c} p={p}")
    sp = par.sequence_parallel  # derive turned it off at t = 1
    e, etp = par.expert_model_parallel_size, sizes.expert_tensor_parallel_size
    sharding = opt.sharding
    return ParallelPlan(
        groups=groups, world=groups.dims.world_size, t=t, c=c, p=p, d=d, v=sizes.virtual_pipeline_model_parallel_size,
        m=sizes.num_microbatches, e=e, etp=etp, edp=groups.dims.world_size // (etp * e * p),
        sequence_parallel=sp, schedule=sizes.pipeline_schedule, placement=groups.placement,
        stages=sizes.stages,
        vocab_barriers=par.vocab_barriers, overlap_moe_expert_parallel_comm=par.overlap_moe_expert_parallel_comm,
        delay_wgrad_compute=par.delay_wgrad_compute, cp_comm_type=par.cp_comm_type,
        linear_cp_comm_type=par.linear_attention_cp_comm_type,
        scatter_gather=par.scatter_gather_tensors_in_pipeline and t > 1 and not sp,
        zero=ZeroPlan(sharding, opt.num_distributed_optimizer_instances if sharding != "no_shard" else 1,
                      tr.overlap_grad_reduce, opt.reshard_after_forward, int(tr.grad_bucket_size_mb * 2**20)),
        dtype=torch.bfloat16 if mp.bf16 else torch.float16 if mp.fp16 else torch.float32,
        # fp32 main grads unless fp16 without --accumulate-allreduce-grads-in-fp32 (Megatron's default)
        grad_dtype=torch.float16 if mp.fp16 and not mp.accumulate_allreduce_grads_in_fp32 else torch.float32,
        seed=tr.seed, micro_batch_size=tr.micro_batch_size, fp8_format=mp.fp8_format, fp8_recipe=mp.fp8_recipe,
        model=config.model, moe=config.moe, lora=config.lora,
    )


def process_groups(config: Config, rank: int, world_size: int, device: torch.device) -> ParallelState:
    """This rank's process groups for ``config``'s layout (``ptdp.parallel.dims``), with the MoE layers'
    folded expert groups (``ptdp.parallel.expert.dims``); collective: every rank calls it."""
    par = config.parallel
    dims = ParallelDims(world_size, par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                        par.context_parallel_size)
    groups = ParallelState(dims, rank, device, schedule_placement(par.schedule))
    if config.moe.num_experts:  # the MoE layers' own etp x e x edp layout over the same ranks
        groups.expert = build_expert_parallel(groups, par.expert_model_parallel_size, par.expert_tensor_parallel_size,
                                              par.sequence_parallel)
    return groups
