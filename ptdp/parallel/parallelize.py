"""This rank's model chunks: a plain model, transformed by each parallelism in turn (torchtitan's shape).

    build on the meta device  →  split into pipeline chunks  →  tensor (+ sequence) parallel
    →  context parallel  →  recompute  →  expert parallel (MoE models)
    →  materialise on the device with one process's values
    →  cast to the parameter dtype  →  FP8 GEMMs (``--fp8-format``)  →  compile (``--compile`` on a GPU)

Each step is one function in its own module and transforms the modules in place; none edits the model
files. Each records how it cut or marked the parameters in the rank's :class:`Placements` registry
(``ptdp.parallel.placement``), returned with the chunks as a :class:`ParallelModel`. A new parallelism adds
a module and one line here (``docs/architecture.md``). Data parallelism is applied to the gradients, not
the model (``ptdp.parallel.data.buffer``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ptdp.config import Config
from ptdp.config.validate_pipeline import stages_of
from ptdp.models import GPTModel
from ptdp.ops.fused import compile_layers, fused_ops
from ptdp.parallel import ParallelState
from ptdp.parallel.context.apply import apply_context_parallel
from ptdp.parallel.expert.apply import apply_expert_parallel
from ptdp.parallel.init import (
    DeferredInit,
    defer_init,
    init_parameters,
    materialize,
    params_dtype,
    record_weight_decay,
)
from ptdp.parallel.pipeline.stage import split_model
from ptdp.parallel.placement import Placements
from ptdp.parallel.recompute import apply_recompute
from ptdp.parallel.tensor.apply import apply_tensor_parallel
from ptdp.parallel.vocab.stage import apply_vocab_parallel
from ptdp.schedule.actions import virtual_stage


def local_seq_length(config: Config, state: ParallelState) -> int:
    """Tokens of one sample on this rank between layers: s/c under context parallelism, and a further
    1/t under sequence parallelism."""
    seq = config.model.seq_length // state.dims.cp
    return seq // state.dims.tp if config.parallel.sequence_parallel and state.dims.tp > 1 else seq


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
                cp_group=None, cp_comm_type: str = "p2p") -> GPTModel:
    """Tensor (+ sequence) and context parallelism and ``model.cfg``'s recomputation, applied in place to
    a model or pipeline chunk (on the meta device, or a real one: then initialise it afterwards), recorded
    in ``placements`` with Megatron's weight-decay rule."""
    m = model.cfg
    apply_tensor_parallel(model, tp_group, placements, sequence_parallel=sequence_parallel)
    apply_context_parallel(model, cp_group, cp_comm_type)
    apply_recompute(model, m.recompute_granularity, m.recompute_method, m.recompute_num_layers,
                    distribute_group=tp_group if m.distribute_saved_activations else None,
                    offload=m.checkpoint_in_cpu)
    record_weight_decay(model, placements)
    return model


def build_model_chunks(config: Config, state: ParallelState, vocab_size: int,
                       padded_vocab_size: int) -> ParallelModel:
    """Chunk c holds virtual stage ``virtual_stage(pp_rank, c, p, placement)`` (``ptdp.parallel.pipeline.stage``)."""
    m, par, p = config.model, config.parallel, state.dims.pp
    v = par.virtual_size
    with torch.device(state.device):  # --compile: the fused ops are built (and probed) here, once per process
        fused_ops(m.compile)
    with torch.device("meta"):  # no memory: only this rank's pieces are ever allocated
        model = GPTModel(m, vocab_size, padded_vocab_size, config.moe)
    stages = [virtual_stage(state.pp_rank, c, p, state.placement) for c in range(v)]
    placements, deferred = Placements(), DeferredInit()
    chunks = split_model(model, stages, p * v, placements, plan=stages_of(config, p, v))  # even or Megatron's
    dtype = params_dtype(config)
    # Every parameter will live in a flat parameter buffer (ZeRO-1/2/3, or a 16-bit model's main copy): then
    # no rank materialises its chunks whole; ZeRO-3 keeps one bucket whole at a time (ptdp.parallel.init).
    defer = (config.optimizer.sharding != "no_shard" or dtype != torch.float32) \
        and not par.enable_vocab_parallel and not m.compile  # these read or draw whole chunks here
    for chunk in chunks:
        parallelize(chunk, placements, tp_group=state.tp_group, sequence_parallel=par.sequence_parallel,
                    cp_group=state.cp_group, cp_comm_type=par.cp_comm_type)
        if config.moe.num_experts:  # issue 25: this rank's experts and the token dispatcher
            apply_expert_parallel(chunk, state.expert, placements, config.moe.moe_token_dispatcher_type,
                                  par.sequence_parallel and state.dims.tp > 1)
        if par.enable_vocab_parallel:  # issue 24: the vocabulary layers split over all pipeline ranks
            apply_vocab_parallel(chunk, chunks.index(chunk), state.pp_rank, p, state.tp_rank, state.dims.tp,
                                 padded_vocab_size, placements)
        if defer:  # drawn straight into the flat parameter buffers, bucket by bucket (ptdp.optim.setup)
            defer_init(chunk, state.device, dtype, placements, deferred, config.training.seed,
                       m.init_method_std, m.num_layers)
        else:
            materialize(chunk, state.device, placements)  # built where it trains: no CPU copy, no H2D move
            init_parameters(chunk, config.training.seed, m.init_method_std, m.num_layers, placements)
        chunk.to(dtype)  # --bf16/--fp16: initialised in fp32 like the fp32 model, then cast
        if config.precision.fp8_format:  # issue 26: FP8 GEMMs in the layers' linears (ptdp/parallel/fp8.py)
            from ptdp.parallel.fp8 import enable_fp8

            enable_fp8([chunk], config.precision.fp8_format, config.precision.fp8_recipe)
        if m.compile:  # on CUDA each layer is compiled whole (on the CPU only the fused element-wise ops)
            compile_layers(chunk.layers.values(),
                           (config.training.micro_batch_size, local_seq_length(config, state), m.hidden_size),
                           dtype)
    return ParallelModel(chunks, placements, deferred)
