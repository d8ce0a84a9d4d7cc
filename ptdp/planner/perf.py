"""Iteration time of one PTD-P layout, from first principles.

Per microbatch, the slowest pipeline stage (the last: its layers plus the logit layer, or the first: its
layers plus the embedding) costs

    T_mb = compute(GEMMs at a size-dependent fraction of peak + memory-bound elementwise ops)
         + recomputation + tensor-parallel all-reduces + pipeline p2p
         + adding the microbatch's weight gradients into the gradient buffer    (nothing overlapped, as in
                                                                             the paper's Megatron)
and one iteration is

    T = (m + (p-1)/v) · T_mb + tied-embedding all-reduce + exposed data-parallel reduction + optimizer step

i.e. ideal time m·T_mb plus the bubble (p-1)/(v·m) of it (docs/references.md, §Schedules and
§Configuration takeaways, 3).
The overlapped schedules (dualpipev, combined 1F1B) hide the MoE token movement and, at t > 1, the layers'
tensor-parallel collectives of their paired passes up to the other microbatch's compute (:func:`overlap_hidden`).
Communication volumes are docs/references.md, §Communication; a collective runs over NVLink when its group fits
in one server and otherwise over the network (Megatron orders ranks t fastest, then d, then p). Every
constant below is a hardware or implementation fact with its source; none is fitted to the paper's
measurements (docs/planner.md compares the result with them).
"""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.config.optimizers import optimizer_spec
from ptdp.planner import experts
from ptdp.planner.gemm import gemm_time
from ptdp.planner.memory import parameters_per_rank
from ptdp.planner.muon import NS_STEPS, MuonWork, muon_work
from ptdp.planner.spec import ClusterSpec, GPTSpec, ParallelConfig, TrainingSpec
from ptdp.planner.stages import rank_layers, ranks_to_check, vocab_parallel_messages, vocab_shares
from ptdp.schedule.registry import bubble_fraction_formula, pair_share

# STREAM-like kernels reach ~80% of HBM bandwidth; NCCL reaches ~80% of NVLink / InfiniBand link rate.
HBM_EFFICIENCY = 0.8
LINK_EFFICIENCY = 0.8
# per ring step latency of a collective (s): NVLink hop, network hop
INTRA_NODE_LATENCY = 2e-6
INTER_NODE_LATENCY = 8e-6
BYTES_PER_ELEMENT = 2  # 16-bit activations


@dataclass(frozen=True)
class StageTimes:
    """Seconds one pipeline rank spends per microbatch (all its v chunks), by kind."""

    compute: float  # the layers' forward + backward GEMMs and elementwise ops
    logits: float  # output layer + cross entropy (last stage) or embedding lookup + its dense grad (first)
    recompute: float  # extra forward work of activation recomputation
    tp_comm: float  # tensor-parallel all-reduces (or all-gather + reduce-scatter)
    p2p: float  # pipeline sends/receives
    grad_accum: float = 0.0  # adding this microbatch's weight gradients into the gradient buffer
    cp_comm: float = 0.0  # context-parallel attention traffic not hidden behind the attention core
    ep_comm: float = 0.0  # MoE token dispatch and combine (planner/experts.py)
    # the part of tp_comm a layer run in pieces issues as exchanges (its halves' entries and exits, 4 per
    # layer), which overlapped pairs hide (overlap_hidden)
    tp_layer_comm: float = 0.0

    @property
    def total(self) -> float:
        return (self.compute + self.logits + self.recompute + self.tp_comm + self.p2p + self.grad_accum
                + self.cp_comm + self.ep_comm)


def cp_bytes_per_layer(model: GPTSpec, cfg: ParallelConfig) -> float:
    """Bytes one CP rank sends per layer per microbatch, forward + backward, at 16 bits.

    With n = s/c local tokens and this TP rank's widths q/t (queries) and k/t (one of K, V): ring attention
    (p2p) passes K and V c-1 hops forward and, in the backward, K/V again with dK/dV (3x the forward);
    Ulysses (a2a) runs 4 all-to-alls each way of b·n·q/t·(c-1)/c (Q, K, V, output); allgather gathers K
    and V and reduce-scatters their gradients, 2·b·s·k/t·(c-1)/c each way (docs/context-parallel.md).
    """
    c, t, b = cfg.context_parallel_size, cfg.tensor_model_parallel_size, cfg.micro_batch_size
    if c == 1:
        return 0.0
    n = model.seq_length / c
    q, k = model.q_width / t, model.kv_width / t
    if cfg.cp_comm_type == "a2a":
        elements = 2 * 4 * b * n * q * (c - 1) / c
    elif cfg.cp_comm_type == "allgather":
        elements = 2 * 2 * b * model.seq_length * k * (c - 1) / c
    else:
        elements = 3 * (c - 1) * 2 * b * n * k
    return elements * BYTES_PER_ELEMENT


def _layer_forward_times(model: GPTSpec, cfg: ParallelConfig, cluster: ClusterSpec) -> tuple[float, float, float]:
    """(GEMM seconds excluding the attention core, attention-core seconds, elementwise seconds) per layer."""
    peak, hbm = cluster.gpu.peak_flops, cluster.gpu.memory_bandwidth * HBM_EFFICIENCY
    t, b = cfg.tensor_model_parallel_size, cfg.micro_batch_size
    h, f, s, a = model.hidden_size, model.active_ffn, model.seq_length, model.num_attention_heads
    q, k = model.q_width, model.kv_width  # h and h for GPT-2; GQA shrinks K and V to G·d each
    gate = 2 if model.swiglu else 1  # SwiGLU's fused gate + up GEMM is twice as wide
    c = cfg.context_parallel_size  # a CP rank: s/c queries against all s keys
    tokens = b * s // c
    dense = (
        gemm_time(tokens, (q + 2 * k) / t, h, peak)  # QKV (column parallel)
        + gemm_time(tokens, h, q / t, peak)  # attention output projection (row parallel)
        + gemm_time(tokens, gate * f / t, h, peak)  # MLP h -> ffn (column parallel)
        + gemm_time(tokens, h, f / t, peak)  # MLP ffn -> h (row parallel)
    )
    heads = b * a / t
    keys = model.attended  # s, or inside packed documents sum(l_i^2)/s
    core = gemm_time(s // c, keys, q / a, peak, heads) + gemm_time(s // c, q / a, keys, peak, heads)  # QK^T, @ V
    # memory-bound ops, bytes moved: 2 LayerNorms (r+w: 8/elt) and 2 dropout+residual (r 2, w 1 + mask: 7/elt)
    # on s·b·h (replicated over t unless sequence parallel), bias+GeLU on the ffn activations (4/elt), and
    # the fused scale-mask-softmax + dropout on the a·s² scores (9/elt)
    sp = cfg.sequence_parallel and t > 1
    elementwise = (22 * tokens * h / (t if sp else 1) + (6 if model.swiglu else 4) * tokens * f / t
                   + 9 * heads * s // c * keys) / hbm  # SwiGLU: read gate and up, write the product
    return dense, core, elementwise


def _link(cluster: ClusterSpec, group_spans_nodes: bool) -> tuple[float, float]:
    if group_spans_nodes:
        return cluster.inter_node_bandwidth * LINK_EFFICIENCY, INTER_NODE_LATENCY
    return cluster.intra_node_bandwidth * LINK_EFFICIENCY, INTRA_NODE_LATENCY


def ring_all_reduce_time(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce: each rank sends and receives 2·(n-1)/n of the buffer in 2·(n-1) steps."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) * latency + 2 * (ranks - 1) / ranks * nbytes / bandwidth


def tp_spans_nodes(cfg: ParallelConfig, cluster: ClusterSpec) -> bool:
    return cfg.tensor_model_parallel_size > cluster.gpus_per_node


def grad_accumulation_bytes_per_param(precision: str) -> int:
    """HBM bytes per parameter per microbatch of Megatron's ``main_grad.add_(param.grad)`` backward hook.

    The weight-gradient GEMM writes a fresh 16-bit ``param.grad``; the hook reads it (2 B) and reads and
    writes the gradient buffer (fp16: 2 + 2 B; fp32 main grads with bf16: 4 + 4 B).
    """
    return 2 + 2 * (2 if precision == "fp16" else 4)


def _stage(model: GPTSpec, cfg: ParallelConfig, cluster: ClusterSpec, precision: str, rank: int) -> StageTimes:
    """Per-microbatch times of ``rank``: its layers (l/p, or the layout's), plus its share of the embedding
    and of the logits (all of it on the first / last stage, 1/p each with vocabulary parallelism)."""
    t, p, v, b = (
        cfg.tensor_model_parallel_size,
        cfg.pipeline_model_parallel_size,
        cfg.virtual_pipeline_model_parallel_size,
        cfg.micro_batch_size,
    )
    h, s, V = model.hidden_size, model.seq_length, model.vocab_size
    hbm = cluster.gpu.memory_bandwidth * HBM_EFFICIENCY
    c = cfg.context_parallel_size
    tokens = b * s // c  # this CP rank's tokens
    layers = rank_layers(model.num_layers, cfg)[rank]
    emb_share, out_share = vocab_shares(cfg, rank)
    dense, core, elementwise = _layer_forward_times(model, cfg, cluster)
    forward = dense + core + elementwise
    # backward = 2x forward GEMMs (dgrad + wgrad) and ~2x the elementwise traffic
    compute = layers * 3 * forward
    if cfg.recompute_granularity == "full":  # the whole forward once more
        recompute = forward
    elif cfg.recompute_granularity == "selective":  # only the attention core and its softmax/dropout
        heads = b * model.num_attention_heads / t
        recompute = core + 9 * heads * s // c * model.attended / hbm
    else:
        recompute = 0.0
    recompute *= layers

    # tensor parallel: 2 all-reduces of b·s·h in forward, 2 in backward, +2 when the forward is recomputed
    # (sequence parallel swaps each for a reduce-scatter + all-gather: same volume); the vocab-parallel
    # embedding all-reduces its output (forward), the logit layer its input gradient (backward)
    bw, lat = _link(cluster, tp_spans_nodes(cfg, cluster))
    collectives = layers * (4 + (2 if cfg.recompute_granularity == "full" else 0))
    ends = 0.0
    if emb_share:
        collectives += 1
        # lookup writes b·s·h (2 B) and its backward zero-fills the dense V/t x h gradient, then scatters
        ends += (2 * tokens * h + emb_share * 2 * V * h / t + 4 * tokens * h) / hbm
    if out_share:
        collectives += 1
        ends += 3 * gemm_time(tokens, out_share * V / t, h, cluster.gpu.peak_flops)
        # vocab-parallel cross entropy on fp32 logits: ~15 passes of 4 B (cast, max, subtract, exp, sum,
        # normalise; backward: softmax minus one-hot, scale, cast back to 16 bits)
        ends += 15 * 4 * tokens * out_share * V / t / hbm
    one = ring_all_reduce_time(tokens * h * BYTES_PER_ELEMENT, t, bw, lat)
    tp_comm = collectives * one

    # pipeline: per chunk, b·s·h forward and back; with t > 1 each rank sends 1/t of it (scatter/gather) and
    # the receivers all-gather over NVLink, unless sequence parallel already keeps the activations split
    p2p = 0.0
    if p > 1:
        bw, lat = _link(cluster, cfg.tensor_model_parallel_size * cfg.data_parallel_size * p > cluster.gpus_per_node)
        message = tokens * h * BYTES_PER_ELEMENT
        one_way = lat + message / t / bw
        if t > 1 and not cfg.sequence_parallel:
            ibw, ilat = _link(cluster, tp_spans_nodes(cfg, cluster))
            one_way += (t - 1) * ilat + (t - 1) / t * message / ibw
        p2p = 2 * v * one_way
        # vocabulary parallelism's barriers: all-reduces of b·s·h over the p ranks of the pipeline (1/t each)
        p2p += vocab_parallel_messages(cfg) * ring_all_reduce_time(message / t, p, bw, lat)

    grad_accum = parameters_per_rank(model, t, p, rank, cfg) * grad_accumulation_bytes_per_param(precision) / hbm
    cp_comm = 0.0
    if c > 1:  # CP ranks sit next to the TP group: inside a node while t·c fits in one
        bw, lat = _link(cluster, t * c > cluster.gpus_per_node)
        seconds = 2 * (c - 1) * lat + cp_bytes_per_layer(model, cfg) / bw
        hidden = 3 * core if cfg.cp_comm_type == "p2p" else 0.0  # the ring overlaps each hop with a block
        cp_comm = layers * max(0.0, seconds - hidden)
    ep_comm = experts.dispatch_seconds(model, cfg, cluster, layers, lambda spans: _link(cluster, spans))
    return StageTimes(compute, ends, recompute, tp_comm, p2p, grad_accum, cp_comm, ep_comm, 4 * layers * one)


def stage_times(model: GPTSpec, cfg: ParallelConfig, cluster: ClusterSpec, precision: str = "fp16") -> StageTimes:
    """Per-microbatch times of the pipeline's slowest stage: the first or the last (docs/references.md, §Schedules),
    or any rank under an uneven layout or vocabulary parallelism.

    In 1F1B every stage waits on its neighbours' blocking sends, so the slowest stage sets the pace.
    """
    return max(rank_stage_times(model, cfg, cluster, precision, ranks_to_check(cfg, model.num_layers)),
               key=lambda st: st.total)


def rank_stage_times(model: GPTSpec, cfg: ParallelConfig, cluster: ClusterSpec, precision: str = "fp16",
                     ranks: list[int] | None = None) -> list[StageTimes]:
    """Per-microbatch times of each pipeline rank (``ranks``, default all): the per-stage picture of how
    the vocabulary layers and the layout balance the pipeline."""
    ranks = range(cfg.pipeline_model_parallel_size) if ranks is None else ranks
    return [_stage(model, cfg, cluster, precision, r) for r in ranks]


@dataclass(frozen=True)
class IterationTimes:
    """Seconds of one iteration, by kind; ``total`` is the iteration time."""

    compute: float
    logits: float
    recompute: float
    tp_comm: float
    p2p: float
    grad_accum: float
    bubble: float
    dp_comm: float
    optimizer: float
    cp_comm: float = 0.0  # context-parallel attention traffic left exposed
    ep_comm: float = 0.0  # MoE token dispatch and combine

    @property
    def total(self) -> float:
        return sum(vars(self).values())


def dp_spans_nodes(cfg: ParallelConfig, cluster: ClusterSpec) -> bool:
    return cfg.tensor_model_parallel_size * cfg.data_parallel_size > cluster.gpus_per_node


def dp_link(cfg: ParallelConfig, cluster: ClusterSpec) -> tuple[float, float]:
    """(bytes/s per GPU, latency per ring step) of the data-parallel all-reduce.

    Ranks go t fastest, then d, so a server holds k = gpus_per_node / t consecutive members of each
    data-parallel group. NCCL builds one ring per NIC and hops between servers once per ring, so a group
    spanning servers moves its data over its k members' k NICs: k x the per-GPU network bandwidth, at
    most NVLink's. With t = 8 (k = 1) that is one NIC per GPU, as before.
    """
    if not dp_spans_nodes(cfg, cluster):
        return _link(cluster, False)
    members_per_node = max(1, min(cfg.data_parallel_size, cluster.gpus_per_node // cfg.tensor_model_parallel_size))
    bandwidth = min(cluster.intra_node_bandwidth, members_per_node * cluster.inter_node_bandwidth)
    return bandwidth * LINK_EFFICIENCY, INTER_NODE_LATENCY


# Megatron's fp16 optimizer step, HBM bytes per local parameter: copy the 16-bit grad into the fp32 main
# grad (r 2, w 4; bf16 main grads are already fp32: 0), unscale + inf check (r 4, w 4), grad-norm for
# clipping (r 4), Adam (r param, grad, m, v: 16; w param, m, v: 12), copy to the 16-bit weights (r 4, w 2)
# and zero the gradient buffer (w grad_bytes).
OPTIMIZER_BYTES_PER_PARAM = 8 + 4 + 28 + 6


def optimizer_bytes_per_param(precision: str) -> int:
    """HBM bytes the optimizer step moves per local parameter (see OPTIMIZER_BYTES_PER_PARAM)."""
    grad_bytes = 2 if precision == "fp16" else 4
    copy = 6 if precision == "fp16" else 0
    return OPTIMIZER_BYTES_PER_PARAM + copy + grad_bytes


def muon_seconds(work: MuonWork, cfg: ParallelConfig, cluster: ClusterSpec) -> float:
    """Muon's step beyond the element-wise update: Newton–Schulz (per step X·Xᵀ, A·A and B·X on the wide form,
    16-bit GEMMs as with Megatron's ``medium`` precision) and the fp32 exchange (each way an all-gather)."""
    peak = cluster.gpu.peak_flops
    ns = sum(n * NS_STEPS * (2 * gemm_time(a, a, b, peak) + gemm_time(a, a, a, peak))
             for r, c, n in work.matrices for a, b in [sorted((r, c))])
    bw, lat = dp_link(cfg, cluster)
    tbw, tlat = _link(cluster, tp_spans_nodes(cfg, cluster))
    return ns + (ring_all_reduce_time(work.dp_bytes, work.dp, bw, lat)
                 + ring_all_reduce_time(work.tp_bytes, cfg.tensor_model_parallel_size, tbw, tlat)) / 2


def iteration_times(model: GPTSpec, cfg: ParallelConfig, cluster: ClusterSpec, train: TrainingSpec) -> IterationTimes:
    """Iteration time = m·T_mb + bubble (p-1)/v·T_mb (or the schedule's own bubble fraction of m·T_mb) +
    exposed DP reduction + optimizer step."""
    t, p, v, d = (
        cfg.tensor_model_parallel_size,
        cfg.pipeline_model_parallel_size,
        cfg.virtual_pipeline_model_parallel_size,
        cfg.data_parallel_size * cfg.context_parallel_size,  # gradients go over the dp-cp group
    )
    m = cfg.num_microbatches(train.global_batch_size)
    stage = stage_times(model, cfg, cluster, train.precision)
    bubble = bubble_fraction_formula(p, v, m, cfg.schedule, cfg.overlap_moe_expert_parallel_comm) * m * stage.total
    hidden = overlap_hidden(cfg, m, stage)
    ep_hidden = min(hidden, m * stage.ep_comm)  # the expert movement first, then the TP exchanges
    ep_comm, tp_hidden = m * stage.ep_comm - ep_hidden, hidden - ep_hidden

    # data parallel: ring all-reduce of the gradients (fp16: 2 B, bf16 main grads: 4 B) once per iteration,
    # or reduce-scatter + param all-gather with the distributed optimizer; only the reduction can overlap
    # with the last microbatch's backward (overlap_grad_reduce), the all-gather precedes the next forward.
    checked = ranks_to_check(cfg, model.num_layers)
    params = max(parameters_per_rank(model, t, p, r, cfg) for r in checked)
    # expert parameters reduce over their expert-data-parallel group, after the dense ones
    expert = max(experts.expert_parameters_per_rank(model, cfg, rank_layers(model.num_layers, cfg)[r]) for r in checked)
    params -= expert
    grad_bytes = 2 if train.precision == "fp16" else 4
    bw, lat = dp_link(cfg, cluster)
    reduce = ring_all_reduce_time(params * grad_bytes, d, bw, lat)
    gather = 0.0
    if cfg.strategy != "no_shard":  # reduce-scatter is half an all-reduce; all-gather 16-bit params
        # (ZeRO-3 as ptdp runs it by default: each chunk gathered once per step, kept through its backward)
        k = cfg.distributed_optimizer_instances
        if k > 1:  # hybrid: within an instance of d/k ranks, then the 1/(d/k) shard all-reduced across k
            inner = ParallelConfig(t, p, d // k, context_parallel_size=cfg.context_parallel_size)
            ibw, ilat = dp_link(inner, cluster)
            reduce = ring_all_reduce_time(params * grad_bytes, d // k, ibw, ilat) / 2 + ring_all_reduce_time(
                params * grad_bytes * k / d, k, bw, lat)
            gather = ring_all_reduce_time(params * BYTES_PER_ELEMENT, d // k, ibw, ilat) / 2
        else:
            reduce /= 2
            gather = ring_all_reduce_time(params * BYTES_PER_ELEMENT, d, bw, lat) / 2
    if train.overlap_grad_reduce:
        reduce = max(0.0, reduce - stage.compute * 2 / 3)  # the last microbatch's backward hides it
    # with p > 1 the first and last stage each hold the tied word embedding and all-reduce its gradient
    # (V·h/t) between them after the flush, across servers, before the data-parallel step
    embedding = 0.0
    if p > 1 and not model.untie_embeddings_and_output_weights and not cfg.enable_vocab_parallel:
        ebw, elat = _link(cluster, t * d * p > cluster.gpus_per_node)
        embedding = ring_all_reduce_time(model.vocab_size * model.hidden_size / t * grad_bytes, 2, ebw, elat)
    edp = experts.expert_data_parallel_size(cfg)
    expert_sync = ring_all_reduce_time(expert * grad_bytes, edp, bw, lat)
    if cfg.strategy != "no_shard":  # reduce-scatter, then the 16-bit parameters all-gathered
        expert_sync = expert_sync / 2 + ring_all_reduce_time(expert * BYTES_PER_ELEMENT, edp, bw, lat) / 2
    dp_comm = reduce + gather + embedding + expert_sync

    local_params = params / max(cfg.shards // cfg.context_parallel_size, 1) + expert / experts.expert_shards(cfg)
    optimizer = local_params * optimizer_bytes_per_param(train.precision) / (
        cluster.gpu.memory_bandwidth * HBM_EFFICIENCY)
    if optimizer_spec(train.optimizer).exchanges_matrices:  # + Muon's: the fullest rank's matrices, exchanged
        layers = max(rank_layers(model.num_layers, cfg)[r] for r in checked)
        optimizer += muon_seconds(muon_work(model, cfg, layers), cfg, cluster)
    return IterationTimes(
        compute=m * stage.compute,
        logits=m * stage.logits,
        recompute=m * stage.recompute,
        tp_comm=m * stage.tp_comm - tp_hidden,
        p2p=m * stage.p2p,
        grad_accum=m * stage.grad_accum,
        bubble=bubble,
        dp_comm=dp_comm,
        optimizer=optimizer,
        cp_comm=m * stage.cp_comm,
        ep_comm=ep_comm,
    )


def overlap_hidden(cfg: ParallelConfig, m: int, stage: StageTimes) -> float:
    """Seconds of communication an iteration hides with overlapped forward-backward pairs (dualpipev, or
    ``--overlap-moe-expert-parallel-comm`` under 1f1b / interleaved; ``ptdp.schedule.dualpipe``): inside a
    pair each microbatch's expert dispatch and combine and, at t > 1, its layers' tensor-parallel collectives
    (the exchanges a layer run in pieces is cut at: ``tp_layer_comm``; the embedding's, the logits' and the
    loss's stay synchronous) run under the other microbatch's compute, so a paired pass hides its
    communication up to that compute (``min(ep_comm + tp_layer_comm, compute)`` per microbatch); the passes
    outside pairs (warm-up, cool-down) hide nothing. The share of paired passes is the schedule's own
    (``pair_share``). ``iteration_times`` takes it from the expert movement first."""
    share = pair_share(cfg.schedule, cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size,
                       m, cfg.overlap_moe_expert_parallel_comm)
    return share * m * min(stage.ep_comm + stage.tp_layer_comm, stage.compute)
