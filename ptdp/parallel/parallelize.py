"""This rank's model chunks: a plain model, transformed by each parallelism in turn (torchtitan's shape).

    build on the meta device  →  split into pipeline chunks  →  tensor (+ sequence) parallel
    →  context parallel  →  recompute  →  expert parallel (MoE models)  →  LoRA adapters (``--lora-rank``)
    →  materialise on the device with one process's values
    →  cast to the parameter dtype  →  FP8 GEMMs (``--fp8-format``)  →  compile (``--compile`` on a GPU)

Each step is one function in its own module and transforms the modules in place; none edits the model
files. :func:`build_model_chunks` reads every size and decision from the rank's plan (``ptdp.parallel.plan``,
resolved once) and hands each step plain groups and flags. Each step records how it cut or marked the
parameters in the rank's :class:`Placements` registry (``ptdp.parallel.placement``), returned with the chunks
as a :class:`ParallelModel`. A new parallelism adds a module and one line here (``docs/architecture.md``).
Data parallelism is applied to the gradients, not the model (``ptdp.parallel.data.buffer``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ptdp.models import GPTModel
from ptdp.models.gpt import on_meta
from ptdp.ops.fused import compile_layers, fused_ops
from ptdp.parallel.context.apply import apply_context_parallel
from ptdp.parallel.expert.apply import apply_expert_parallel
from ptdp.parallel.init import DeferredInit, defer_init, init_parameters, materialize, record_weight_decay
from ptdp.parallel.lora import apply_lora
from ptdp.parallel.pipeline.parts import ChunkParts
from ptdp.parallel.pipeline.stage import split_model
from ptdp.parallel.placement import Placements
from ptdp.parallel.plan import ParallelPlan
from ptdp.parallel.recompute import apply_recompute
from ptdp.parallel.tensor.apply import apply_tensor_parallel
from ptdp.parallel.vocab.stage import apply_vocab_parallel
from ptdp.schedule.actions import virtual_stage


@dataclass
class ParallelModel:
    """This rank's model: its chunks (in the order of its virtual stages), the placement of each of their
    parameters, and the parameters whose initial values wait for the flat parameter buffers (``deferred``:
    ``ptdp.optim.setup`` hands it to them)."""

    chunks: list[GPTModel]
    placements: Placements
    deferred: DeferredInit = field(default_factory=DeferredInit)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for chunk in self.chunks for p in chunk.parameters()]


def parallelize(model: GPTModel, placements: Placements, *, tp_group=None, sequence_parallel: bool = False,
                cp_group=None, cp_comm_type: str = "p2p", linear_cp_comm_type: str = "state_passing") -> GPTModel:
    """Tensor (+ sequence) and context parallelism and ``model.cfg``'s recomputation, applied in place to
    a model or pipeline chunk (on the meta device, or a real one: then initialise it afterwards), recorded
    in ``placements`` with Megatron's weight-decay rule."""
    m = model.cfg
    apply_tensor_parallel(model, tp_group, placements, sequence_parallel=sequence_parallel)
    apply_context_parallel(model, cp_group, cp_comm_type, linear_cp_comm_type)
    apply_recompute(model, m.recompute_granularity, m.recompute_method, m.recompute_num_layers,
                    distribute_group=tp_group if m.distribute_saved_activations else None,
                    offload=m.checkpoint_in_cpu)
    record_weight_decay(model, placements)
    return model


def build_model_chunks(plan: ParallelPlan, vocab_size: int, padded_vocab_size: int) -> ParallelModel:
    """This rank's chunks of ``plan.model``: chunk c holds virtual stage ``virtual_stage(pp_rank, c, p,
    placement)`` (``ptdp.parallel.pipeline.stage``)."""
    m, g, p, v = plan.model, plan.groups, plan.p, plan.v
    with torch.device(g.device):  # --compile: the fused ops are built (and probed) here, once per process
        fused_ops(m.compile)
    with on_meta():  # no memory: only this rank's pieces are ever allocated
        model = GPTModel(m, vocab_size, padded_vocab_size, plan.moe)
    stages = [virtual_stage(g.pp_rank, c, p, plan.placement) for c in range(v)]
    placements, deferred = Placements(), DeferredInit()
    chunks = split_model(model, stages, p * v, placements, plan=plan.stages)  # even or Megatron's
    for chunk in chunks:
        parallelize(chunk, placements, tp_group=g.tp_group, sequence_parallel=plan.sequence_parallel,
                    cp_group=g.cp_group, cp_comm_type=plan.cp_comm_type,
                    linear_cp_comm_type=plan.linear_cp_comm_type)
        if plan.moe.num_experts:  # this rank's experts and the token dispatcher
            apply_expert_parallel(chunk, g.expert, placements, plan.moe.moe_token_dispatcher_type,
                                  plan.sequence_parallel)
        if plan.vocab_parallel:  # the vocabulary layers split over all pipeline ranks
            apply_vocab_parallel(chunk, chunks.index(chunk), g.pp_rank, p, g.tp_rank, plan.t,
                                 padded_vocab_size, placements)
        if plan.lora.lora_rank:  # LoRA: adapters beside the targeted linears, everything else frozen
            apply_lora(chunk, plan.lora, placements, g.tp_group, plan.sequence_parallel)
        # Every parameter will live in a flat parameter buffer (ZeRO-1/2/3, or a 16-bit model's main copy): then
        # no rank materialises its chunks whole; ZeRO-3 keeps one bucket whole at a time (ptdp.parallel.init).
        if plan.defer_init:  # drawn straight into the flat parameter buffers, bucket by bucket (ptdp.optim.setup)
            defer_init(chunk, g.device, plan.dtype, placements, deferred, plan.seed, m.init_method_std, m.num_layers)
        else:
            materialize(chunk, g.device, placements)  # built where it trains: no CPU copy, no H2D move
            init_parameters(chunk, plan.seed, m.init_method_std, m.num_layers, placements)
        chunk.to(plan.dtype)  # --bf16/--fp16: initialised in fp32 like the fp32 model, then cast
        if plan.fp8_format:  # FP8 GEMMs in the layers' linears (ptdp/parallel/fp8.py)
            from ptdp.parallel.fp8 import enable_fp8

            enable_fp8([chunk], plan.fp8_format, plan.fp8_recipe)
        if m.compile:  # on CUDA each layer is compiled whole (on the CPU only the fused element-wise ops)
            parts = ChunkParts(chunk)
            compile_layers(parts.layers.values(), (plan.micro_batch_size, plan.local_seq_length, m.hidden_size),
                           plan.dtype)
    return ParallelModel(chunks, placements, deferred)
