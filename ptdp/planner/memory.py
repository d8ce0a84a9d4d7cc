"""Memory per GPU: model states (weights, grads, optimizer) plus stashed activations, for the worst rank.

Model states use Megatron's distributed-optimizer bytes/param table, activations Korthikanti et al.'s
per-layer count (docs/references.md, §Memory). Pipeline rank 0 holds the word + position embeddings and stashes
the most microbatches; the last rank holds the (tied) output layer and the fp32 logits. Every other rank
is dominated by rank 0, so the planner checks those two.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ptdp.config.optimizers import optimizer_spec
from ptdp.models.flops import architecture, layer_parameter_count, norm_parameters
from ptdp.planner import experts
from ptdp.planner.memory_linear import mixer_bytes_per_token
from ptdp.planner.spec import GPTSpec, ParallelConfig
from ptdp.planner.stages import (
    end_ranks,
    rank_kind,
    rank_layers,
    ranks_to_check,
    vocab_parallel_extra_stashes,
    vocab_shares,
)
from ptdp.schedule.registry import schedule_spec

# CUDA context, cuBLAS workspaces, NCCL buffers and allocator slack that any job pays (an assumption:
# typically 1-3 GiB on A100/H100 with NCCL); counted once per GPU.
RUNTIME_OVERHEAD_BYTES = 2 * 1024**3

# bytes/param held for (parameters, gradients, what the optimizer owns besides its state: fp32 master copy of
# 16-bit weights, fp32 main grads of 16-bit grads) -- docs/references.md, §Memory and §ZeRO; plus the state:
_STATE_BYTES = {"fp16": (2, 2, 8), "bf16": (2, 4, 4), "fp32": (4, 4, 0)}
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def model_state_bytes_per_param(precision: str, distributed_optimizer: bool | str, data_parallel_size: int,
                                state_bytes: int = 8) -> float:
    """Bytes per parameter of one rank's model states under a ZeRO strategy sharded over
    ``data_parallel_size`` ranks (``distributed_optimizer``: a strategy name, or a bool meaning ``optim`` /
    ``no_shard``), with ``state_bytes`` of optimizer state (AdamW's 8 by default). ``optim`` (ZeRO-1): 20 ->
    4 + 16/d (fp16), 18 -> 6 + 12/d (bf16), 16 -> 8 + 8/d (fp32); ``optim_grads`` (ZeRO-2) shards the
    gradients too (fp32: 4 + 12/d), ``optim_grads_params`` (ZeRO-3) everything (fp32: 16/d). Muon's
    matrices: 4 bytes less before sharding (fp32: 12 -> 8 + 4/d under ZeRO-1)."""
    strategy = distributed_optimizer if isinstance(distributed_optimizer, str) else (
        "optim" if distributed_optimizer else "no_shard")
    params, grads, owned = _STATE_BYTES[precision]
    owned += state_bytes
    s = max(data_parallel_size, 1)
    if strategy == "no_shard":
        return float(params + grads + owned)
    if strategy == "optim":
        return params + grads + owned / s
    if strategy == "optim_grads":
        return params + (grads + owned) / s
    if strategy == "optim_grads_params":
        return (params + grads + owned) / s
    raise ValueError(f"unknown sharding strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")


def _owned_divisor(strategy: str, shards: int) -> int:
    """What the optimizer's own bytes are divided by: the shards under any ZeRO strategy, else 1."""
    return 1 if strategy == "no_shard" else max(shards, 1)


def step_buffer_bytes_per_param(precision: str, strategy: str) -> float:
    """Bytes per parameter that ZeRO-2/3 hold only during the step: the full gradient buffer (stages 2
    and 3) and the gathered 16-bit or fp32 parameters (stage 3)."""
    params, grads, _ = _STATE_BYTES[precision]
    return {"optim_grads": grads, "optim_grads_params": grads + params}.get(strategy, 0.0)


def muon_step_bytes_per_param(shards: int, grid: int, tp: int = 1) -> float:
    """Bytes per hidden-matrix parameter of a rank that Muon's step holds only while it runs
    (``ptdp.optim.muon_exchange``), ``grid`` being the D data-parallel ranks of the exchange: the update of
    the range this rank holds (4 bytes, over ``shards`` under ZeRO); for the matrices whose data-parallel
    owner it is -- 1/D of its tensor-parallel slices -- the assembled slices and the updates handed back
    (4 + 4 bytes), and with ``tp`` > 1 the whole matrices concatenated from the slices (4 more); and the
    data-parallel scatter's send and receive buffers, alive with all of these: the owner sends the held
    ranges of the other D - 1 ranks and receives the range it holds of every matrix it does not own, each
    4·(D - 1)/D of a held range (1/``shards`` of the slices). Measured against it: benchmarks/muon.py.
    Its time: ``ptdp.planner.muon``."""
    d = max(grid, 1)
    exchange = 8 * (d - 1) / d / max(shards, 1)
    return 4 / max(shards, 1) + (8 + (4 if tp > 1 else 0)) / d + exchange


def _norm_params(model: GPTSpec) -> int:
    return norm_parameters(model.hidden_size, model.normalization, not model.disable_bias_norm)


def layer_parameters_per_rank(model: GPTSpec, t: int, cfg: ParallelConfig | None = None) -> float:
    """One layer's parameters on one tensor-parallel rank: weights and column-parallel biases split t ways.

    Replicated: the row-parallel biases (2h, none with ``disable_bias_linear``) and the two norms (4h
    LayerNorm, 2h RMSNorm). A mixture of experts: the mean layer, experts split over e·etp (``experts.py``).
    """
    if model.moe is not None:
        return experts.layer_parameters_per_rank(model, t, cfg)
    return _dense_layer_parameters_per_rank(model, t)


@functools.lru_cache(maxsize=1024)  # the planner asks for each of thousands of layouts: a few t
def _dense_layer_parameters_per_rank(model: GPTSpec, t: int) -> float:
    h, f = model.hidden_size, model.parameter_ffn
    replicated = 2 * _norm_params(model) + (0 if model.disable_bias_linear else 2 * h) + model.mla_replicated
    total = layer_parameter_count(h, f, bias=not model.disable_bias_linear, normalization=model.normalization,
                                  norm_bias=not model.disable_bias_norm, **architecture(model))
    return (total - replicated) / t + replicated


def hidden_matrix_fraction(model: GPTSpec, t: int, cfg: ParallelConfig | None = None) -> float:
    """The share of one layer's parameters on a tensor-parallel rank that are hidden matrices (what Muon
    steps): all but the two norms and the linear biases."""
    h, layer = model.hidden_size, layer_parameters_per_rank(model, t, cfg)
    biases = 0.0 if model.disable_bias_linear else (
        model.q_width + 2 * model.kv_width + (0 if model.moe else (2 if model.swiglu else 1) * model.ffn)) / t + 2 * h
    return max(0.0, 1.0 - (2 * _norm_params(model) + biases) / layer)


def parameters_per_rank(model: GPTSpec, t: int, p: int, pipeline_rank: int, cfg: ParallelConfig | None = None) -> float:
    """Parameters held by one GPU at ``pipeline_rank``, padding of the vocabulary ignored.

    Rank 0: its layers + V·h/t word embedding + s·h positions (none with rotary positions); last rank:
    its layers + the output layer V·h/t (the tied embedding's own copy when p > 1; an untied output layer
    always) + final norm (when p == 1 and tied, the embedding serves both ends). With ``cfg``: its layout's
    layers, and under vocabulary parallelism a V/p slice of each vocabulary table on every rank (one
    slice serves both ends when tied).
    """
    h = model.hidden_size
    untied = model.untie_embeddings_and_output_weights
    vp = cfg is not None and cfg.enable_vocab_parallel and p > 1
    if cfg is None:
        layers, emb, out = model.num_layers / p, float(pipeline_rank == 0), float(pipeline_rank == p - 1)
        first, last = 0, p - 1
    else:
        layers, (emb, out) = rank_layers(model.num_layers, cfg)[pipeline_rank], vocab_shares(cfg, pipeline_rank)
        first, last = end_ranks(cfg)
    first, last = pipeline_rank == first, pipeline_rank == last  # positions / final norm stay at the ends
    params = layers * layer_parameters_per_rank(model, t, cfg)
    if emb:
        params += emb * model.vocab_size * h / t
    if first and model.position_embedding_type != "rope":
        params += model.seq_length * h
    if last:  # the final norm; the MTP modules: a layer like the mean one, eh_proj [h, 2h], three norms each
        params += _norm_params(model) + model.mtp_num_layers * (
            layer_parameters_per_rank(model, t, cfg) + 2 * h * h / t + 3 * _norm_params(model))
    if out and (untied or (p > 1 and not vp)):  # an untied head, or the tied table's copy on another rank
        params += out * model.vocab_size * h / t
    return params


def activation_bytes_per_layer(model: GPTSpec, cfg: ParallelConfig, stashed: bool = True) -> float:
    """Activation bytes one layer keeps per microbatch at 16 bits (Korthikanti et al., docs/references.md, §Memory).

    Without recomputation, t = 1: ``s·b·(18h + 4·ffn) + 5·a·s²·b`` (= s·b·h·(34 + 5as/h) for ffn = 4h).
    Tensor parallelism splits all but ``10·s·b·h`` (LayerNorm inputs, the inputs of the QKV and first MLP
    GEMMs and two dropout masks); sequence parallelism splits those too. The split attention part is
    ``2·s·b·(2q + 2k)`` (Q, K, V and the output projection's input, q = a·d, k = G·d: 8·s·b·h for GPT-2,
    less with GQA); the MLP's ``4·ffn`` (GeLU input, fc2 input) becomes ``8·ffn`` with SwiGLU (gate, up,
    silu(gate) and the product). RMSNorm keeps its input like LayerNorm; RoPE saves nothing extra. Selective recomputation drops the
    ``5·a·s²·b`` attention-core term. Full recomputation stashes only the layer input ``2·s·b·h`` (split t
    ways under sequence parallelism) -- ``stashed=False`` gives the full working set one layer rebuilds.
    Context parallelism (c > 1) holds s/c tokens per rank: every per-token term shrinks c-fold, and the
    attention core keeps (s/c)·s scores per head (docs/context-parallel.md), also 1/c of the s² term.
    Gated DeltaNet layers (and the attention output gate) count their own mixer, linear in s
    (``ptdp.planner.memory_linear``), averaged over the model's layers like their FLOPs.
    """
    c = cfg.context_parallel_size
    s, b, h, a, t = model.seq_length // c, cfg.micro_batch_size, model.hidden_size, model.num_attention_heads, (
        cfg.tensor_model_parallel_size
    )
    sp = cfg.sequence_parallel and t > 1
    if stashed and cfg.recompute_granularity == "full":
        return 2 * s * b * h / (t if sp else 1)
    replicated = 10 * s * b * h + (2 * s * b * model.mla.latent_width() if model.mla is not None else 0)
    selective = cfg.recompute_granularity == "selective" and stashed
    attention_core = 0 if selective else 5 * a * model.attended
    attention = mixer_bytes_per_token(model.linear, 4 * model.q_width + 4 * model.kv_width + attention_core,
                                      model.q_width, selective)
    split = s * b * (attention + (8 if model.swiglu else 4) * model.active_ffn)
    return (replicated / (t if sp else 1)) + split / t


def cut_layer_extra_bytes(model: GPTSpec, cfg: ParallelConfig) -> float:
    """What a layer run in pieces (an overlapped pair's, ``ptdp.parallel.pipeline.program``) keeps per microbatch
    beyond :func:`activation_bytes_per_layer`: under sequence parallelism each half cut at its
    tensor-parallel exchanges keeps its first GEMM's *gathered* input (QKV, fc1) for the backward, where the
    plain run keeps the s/t shard and gathers again (docs/dualpipe.md) -- 2·s·b·h·(1 - 1/t) bytes a GEMM.
    Not cut: multi-latent attention, a MoE layer's MLP (its experts take the dispatched tokens)."""
    t = cfg.tensor_model_parallel_size
    if not cfg.sequence_parallel or t == 1 or cfg.recompute_granularity == "full":
        return 0.0
    gathered = 2 * model.seq_length // cfg.context_parallel_size * cfg.micro_batch_size * model.hidden_size
    dense_mlps = 1 - (model.moe.moe_layers / model.num_layers if model.moe is not None else 0)
    return ((model.mla is None) + dense_mlps) * gathered * (1 - 1 / t)


def activation_microbatches_in_flight(schedule: str, p: int, v: int, m: int, rank: int, overlap: bool = False) -> int:
    """Peak (microbatch, chunk) activation stashes on ``rank``; each holds l/(p·v) layers.

    Closed form of ``ptdp.parallel.pipeline.schedules.peak_in_flight`` (docs/references.md, §Schedules): GPipe m, 1F1B
    min(p - r, m), interleaved Megatron's warm-up count + 1 (the steady state's forward runs before its
    backward), capped at m·v. The zero-bubble schedules keep a stash until its W: ``peak_stashed`` of
    their list (ZB-H1 min(p, m) on every rank, ZB-V 2p chunks of l/(2p) layers, V-Half and V-Min less),
    DualPipeV 2p + 1 (DualPipe's PP + 1 with PP = 2p stages); ``overlap`` (combined 1F1B) one more microbatch.
    """
    return schedule_spec(schedule).stashes(p, v, m, rank, overlap)  # the registry's memory formula


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the fullest GPU, by kind."""

    model_states: float
    activations: float
    overhead: float
    pipeline_rank: int
    # ZeRO-2/3 during the step: the full gradient buffers of the backward (freed once reduce-scattered)
    # and, at ZeRO-3, the rank's gathered parameters (ptdp keeps each chunk gathered through its backward)
    step_buffers: float = 0.0

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.overhead + self.step_buffers


def memory_per_gpu(model: GPTSpec, cfg: ParallelConfig, global_batch_size: int, precision: str,
                   optimizer: str = "adam") -> MemoryEstimate:
    """Memory of the fullest GPU: max over pipeline rank 0 (embeddings, most stashes) and the last rank
    (every rank under an uneven layout or vocabulary parallelism)."""
    return max(rank_memory(model, cfg, global_batch_size, precision, ranks_to_check(cfg), optimizer),
               key=lambda e: e.total)


def rank_memory(model: GPTSpec, cfg: ParallelConfig, global_batch_size: int, precision: str,
                ranks: list[int] | None = None, optimizer: str = "adam") -> list[MemoryEstimate]:
    """Memory of each pipeline rank in ``ranks`` (default all): layers from the layout, the vocabulary
    tables and fp32 logits where they live (1/p of them everywhere under vocabulary parallelism).
    ``optimizer``: its state bytes per parameter (``ptdp.config.optimizers.OptimizerSpec``: AdamW 8, SGD 4);
    one whose hidden matrices keep another state (Muon: 4 bytes instead of AdamW's 8) counts them apart, and
    one that exchanges the matrices holds the gather's buffers during its step
    (:func:`muon_step_bytes_per_param`) instead of ZeRO-2/3's, which are freed by then."""
    t, p, v = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size
    m = cfg.num_microbatches(global_batch_size)
    spec = optimizer_spec(optimizer)
    state, rest_state = spec.matrix_state_bytes, spec.state_bytes  # Muon's rest_state: its AdamW part
    # ZeRO shards over the dp-cp group (parameters are replicated over CP too), or one hybrid instance of it
    per_param = model_state_bytes_per_param(precision, cfg.strategy, cfg.shards, rest_state)
    # expert parameters shard over their expert-data-parallel group instead
    expert_per_param = model_state_bytes_per_param(precision, cfg.strategy, experts.expert_shards(cfg), rest_state)
    saved = state - rest_state  # per hidden-matrix parameter, sharded like the rest of the state
    matrix = hidden_matrix_fraction(model, t, cfg) if spec.matrices_apart else 0.0
    grid = cfg.data_parallel_size * cfg.context_parallel_size // cfg.distributed_optimizer_instances
    muon_step = muon_step_bytes_per_param(cfg.shards, grid, t) if spec.exchanges_matrices else 0.0
    step_per_param = step_buffer_bytes_per_param(precision, cfg.strategy)
    layers = rank_layers(model.num_layers, cfg)
    stash = activation_bytes_per_layer(model, cfg)
    if schedule_spec(cfg.schedule).runs_pairs(cfg.overlap_moe_expert_parallel_comm):
        stash += cut_layer_extra_bytes(model, cfg)  # every stash counted as a pair's: an upper bound
    # a layer being recomputed or run in backward materialises its whole working set once
    working = activation_bytes_per_layer(model, cfg, stashed=False) if cfg.recompute_granularity == "full" else 0.0
    out_list = []
    ends, params_of = end_ranks(cfg), {}  # ranks of one kind hold the same parameters
    for rank in range(p) if ranks is None else ranks:
        kind = rank_kind(cfg, rank, layers, ends)
        if kind not in params_of:
            params_of[kind] = parameters_per_rank(model, t, p, rank, cfg)
        in_flight = min(activation_microbatches_in_flight(cfg.schedule, p, v, m, rank,
                                                          cfg.overlap_moe_expert_parallel_comm)
                        + vocab_parallel_extra_stashes(cfg), m * v)
        mtp = model.mtp_num_layers if rank == ends[1] else 0  # the MTP modules: more layers on the last rank
        acts = in_flight * (layers[rank] + mtp) / v * stash + working
        out = vocab_shares(cfg, rank)[1]  # fp32 logits for the vocab-parallel cross entropy, one microbatch
        acts += (out + (mtp > 0) * model.mtp_num_layers * out) * 4 * model.seq_length // cfg.context_parallel_size \
            * cfg.micro_batch_size * model.vocab_size / t  # ... and one more logit tensor per MTP module
        params, expert = params_of[kind], experts.expert_parameters_per_rank(model, cfg, layers[rank] + mtp)
        states = (params - expert) * per_param + expert * expert_per_param
        matrices = layers[rank] * layer_parameters_per_rank(model, t, cfg) * matrix
        if matrices:  # Muon's matrices (the experts' all are): one momentum instead of two moments, sharded alike
            states += saved * (max(matrices - expert, 0.0) / _owned_divisor(cfg.strategy, cfg.shards)
                               + expert / _owned_divisor(cfg.strategy, experts.expert_shards(cfg)))
        step = max(params * step_per_param, matrices * muon_step)
        out_list.append(MemoryEstimate(states, acts, RUNTIME_OVERHEAD_BYTES, rank, step))
    return out_list
