"""Expert parallelism in the planner: what e and etp change in memory, time and validity.

A mixture-of-experts layer keeps attention's ``t × c × d × p`` layout; its experts are split over the
``etp × e × edp`` view of the same ranks (MoE Parallel Folding, ``ptdp.parallel.expert.dims``):

* **memory**: of one MoE layer, the E stacked experts (``mats·h·ffn_moe`` each, bias-free) are held 1/(e·etp)
  per rank; the router (E·h), the shared expert and its gate are replicated over the tensor-parallel group
  (``ptdp.parallel.expert.apply``: tensor parallelism leaves the MoE layer whole); attention and the norms are
  split as in a dense layer. Expert gradients and optimizer states shard over the expert-data-parallel
  group, ``edp = t·c·d / (etp·e)`` ranks (``ptdp.parallel.expert.grads``), not over attention's d·c.
* **time**: every MoE layer dispatches its routed tokens to the experts' ranks and combines them back,
  forward and backward (again when recomputed): ``alltoall`` sends the ``k`` (token, choice) pairs that leave
  the rank, (e-1)/e of them; ``allgather`` gathers every token of the group and reduce-scatters the outputs.
  With etp = t under sequence parallelism the tokens are first gathered over the TP group and the output
  reduce-scattered (``ptdp.parallel.expert.dispatch``). Expert gradients reduce over edp ranks.
  The expert GEMMs do the same work per rank whatever e (each rank runs its E/e experts on the tokens
  routed to them), so compute stays ``ptdp.planner.perf``'s active-FFN count.
* **validity**: the rules of ``ptdp.parallel.expert.dims.expert_layout_errors``.

Pure arithmetic: no torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence

from ptdp.config.validate_moe import expert_layout_errors
from ptdp.models.flops import architecture, layer_parameter_count, norm_parameters
from ptdp.planner.spec import ClusterSpec, GPTSpec, ParallelConfig

Link = Callable[[bool], tuple[float, float]]  # spans nodes -> (bytes/s, latency): the planner's link model
DISPATCHERS = ("alltoall", "allgather")
DEFAULT_DISPATCHER = "allgather"  # --moe-token-dispatcher-type's default (Megatron-LM's)
BYTES_PER_ELEMENT = 2  # 16-bit activations


def expert_sizes(cfg: ParallelConfig) -> tuple[int, int]:
    """(e, etp) of a planner ``ParallelConfig``: etp defaults to t, as Megatron-Core's."""
    etp = cfg.expert_tensor_parallel_size
    return cfg.expert_model_parallel_size, cfg.tensor_model_parallel_size if etp is None else etp


def expert_data_parallel_size(cfg: ParallelConfig) -> int:
    """edp: the ranks of one pipeline stage holding the same experts, t·c·d / (etp·e)."""
    e, etp = expert_sizes(cfg)
    stage = cfg.tensor_model_parallel_size * cfg.context_parallel_size * cfg.data_parallel_size
    return max(stage // (etp * e), 1)


def expert_shards(cfg: ParallelConfig) -> int:
    """How many ranks split what the ZeRO strategy shards of the experts: the edp group (one hybrid
    instance of it when K divides it)."""
    if cfg.strategy == "no_shard":
        return 1
    edp, k = expert_data_parallel_size(cfg), cfg.distributed_optimizer_instances
    return edp // k if k > 1 and edp % k == 0 else edp


def _mats(model: GPTSpec) -> int:
    return 3 if model.swiglu else 2


@functools.lru_cache(maxsize=1024)  # the planner asks for each of thousands of layouts: a few (t, e, etp)
def layer_parameters(model: GPTSpec, t: int, e: int = 1, etp: int | None = None) -> tuple[float, float]:
    """(non-expert, expert) parameters of the mean layer on one rank of a MoE model (``model.moe`` set).

    Dense layers: all but the two norms and the row-parallel biases split t ways. MoE layers: attention
    alike, the router / shared expert / its gate replicated, the E experts split e·etp ways.
    """
    moe, h, etp = model.moe, model.hidden_size, t if etp is None else etp
    arch, bias = architecture(model), not model.disable_bias_linear
    norm_bias = not model.disable_bias_norm
    norms = 2 * norm_parameters(h, model.normalization, norm_bias)
    row_bias = 0 if model.disable_bias_linear else 2 * h  # attention output and MLP output biases

    mla = model.mla_replicated  # multi-latent attention's down projections and latent norms stay whole
    dense = layer_parameter_count(h, model.ffn, bias=bias, normalization=model.normalization, norm_bias=norm_bias,
                                  **arch)
    dense_rank = (dense - norms - row_bias - mla) / t + norms + row_bias + mla
    whole = layer_parameter_count(h, model.ffn, bias=bias, normalization=model.normalization, moe=moe,
                                  norm_bias=norm_bias, **arch)
    experts = moe.num_experts * _mats(model) * h * moe.ffn
    router = moe.num_experts * h
    shared = _mats(model) * h * moe.shared_ffn + (h if moe.shared_gate else 0)
    shared_bias = ((2 if model.swiglu else 1) * moe.shared_ffn + h) if (moe.shared_ffn and bias) else 0
    replicated = router + shared + shared_bias + norms + (h if bias else 0) + mla  # + the attention output bias
    attention = whole - experts - replicated
    moe_rank = attention / t + replicated
    layers, m = model.num_layers, moe.moe_layers
    return ((layers - m) * dense_rank + m * moe_rank) / layers, m * experts / (e * etp) / layers


def layer_parameters_per_rank(model: GPTSpec, t: int, cfg: ParallelConfig | None = None) -> float:
    """All parameters of the mean layer on one rank (``memory.layer_parameters_per_rank`` for a MoE model)."""
    e, etp = expert_sizes(cfg) if cfg is not None else (1, t)
    return sum(layer_parameters(model, t, e, etp))


def expert_parameters_per_rank(model: GPTSpec, cfg: ParallelConfig, layers: float) -> float:
    """The expert parameters of ``layers`` (mean) layers on one rank: 0 for a dense model."""
    if model.moe is None:
        return 0.0
    e, etp = expert_sizes(cfg)
    return layers * layer_parameters(model, cfg.tensor_model_parallel_size, e, etp)[1]


def expert_layout_problem(model: GPTSpec, cfg: ParallelConfig, world_size: int) -> str | None:
    """Why ``ptdp train`` would refuse this expert layout (naming the flag), or None: the rules of
    ``ptdp.parallel.expert.dims.expert_layout_errors``."""
    e, etp = expert_sizes(cfg)
    dispatcher = cfg.moe_token_dispatcher_type
    if dispatcher not in DISPATCHERS:
        return f"--moe-token-dispatcher-type must be one of {', '.join(DISPATCHERS)}, got {dispatcher!r}"
    c = cfg.context_parallel_size
    errors = expert_layout_errors(
        world_size=world_size, t=cfg.tensor_model_parallel_size, c=c, p=cfg.pipeline_model_parallel_size,
        e=e, etp=cfg.expert_tensor_parallel_size,
        num_experts=None if model.moe is None else model.moe.num_experts, sequence_parallel=cfg.sequence_parallel,
        tokens_per_rank=cfg.micro_batch_size * model.seq_length // c)
    return errors[0] if errors else None


def expert_choices(model: GPTSpec, t: int, c: int, d: int, expert_sizes_: Sequence[int] | None = None,
                   expert_tensor_sizes: Sequence[int | None] | None = None,
                   dispatchers: Sequence[str] | None = None) -> Iterator[tuple[int, int | None, str]]:
    """(e, etp, dispatcher) triples to search for a stage of t·c·d ranks: e divides E and folds with etp over
    the stage (etp = t, Megatron-Core's default, written None; and etp = 1 when t > 1), with either
    dispatcher when e > 1 (``ptdp train``'s default, allgather, at e = 1, where nothing moves); (1, None,
    allgather) for a dense model. A given sequence pins that dimension."""
    if model.moe is None:
        yield 1, None, DEFAULT_DISPATCHER
        return
    stage = t * c * d
    for etp in expert_tensor_sizes or ([None, 1] if t > 1 else [None]):
        width = t if etp is None else etp
        for e in expert_sizes_ or [k for k in range(1, model.moe.num_experts + 1) if model.moe.num_experts % k == 0]:
            if stage % (width * e) == 0:
                for dispatcher in dispatchers or (DISPATCHERS if e > 1 else [DEFAULT_DISPATCHER]):
                    yield e, etp, dispatcher


def _routed_tokens(model: GPTSpec, cfg: ParallelConfig) -> tuple[float, float]:
    """(tokens this rank sends to the experts per MoE layer per microbatch, tokens it gathers over the
    expert-tensor group first)."""
    t, e_tp = cfg.tensor_model_parallel_size, expert_sizes(cfg)[1]
    tokens = cfg.micro_batch_size * model.seq_length / cfg.context_parallel_size
    sp = cfg.sequence_parallel and t > 1
    if e_tp == 1:
        return tokens / t, 0.0  # each TP rank routes its own 1/t (its SP slice, or a slice of the replica)
    return tokens, (tokens if sp else 0.0)  # etp = t: the TP group shares (SP: gathers) the tokens


def dispatch_seconds_per_layer(model: GPTSpec, cfg: ParallelConfig, cluster: ClusterSpec, link: Link) -> float:
    """Seconds one MoE layer spends moving tokens per microbatch (forward, backward and any recomputed
    forward) on one rank. ``link(spans_nodes) -> (bytes/s, latency)`` is the planner's link model."""
    if model.moe is None:
        return 0.0
    e, etp = expert_sizes(cfg)
    routed, gathered = _routed_tokens(model, cfg)
    h, k = model.hidden_size, model.moe.topk
    passes = 2 + (1 if cfg.recompute_granularity == "full" else 0)  # forward, backward, recomputed forward
    seconds = 0.0
    if e > 1:
        bw, lat = link(etp * e > cluster.gpus_per_node)  # the ep group: every etp-th rank of etp·e in a row
        if cfg.moe_token_dispatcher_type == "allgather":
            sent = 2 * (e - 1) * routed * h  # all-gather the tokens, reduce-scatter the outputs
        else:
            sent = 2 * (e - 1) / e * routed * k * h  # the pairs leaving the rank, there and back
        seconds += passes * ((2 * (e - 1)) * lat + sent * BYTES_PER_ELEMENT / bw)
    if gathered:  # SP with etp = t: all-gather before and reduce-scatter after, over the TP group
        bw, lat = link(etp > cluster.gpus_per_node)
        seconds += passes * 2 * ((etp - 1) * lat + (etp - 1) / etp * gathered * h * BYTES_PER_ELEMENT / bw)
    return seconds


def dispatch_seconds(model: GPTSpec, cfg: ParallelConfig, cluster: ClusterSpec, layers: float, link: Link) -> float:
    """Token movement of the MoE layers among ``layers`` (mean) layers, per microbatch."""
    if model.moe is None:
        return 0.0
    return layers * model.moe.moe_layers / model.num_layers * dispatch_seconds_per_layer(model, cfg, cluster, link)


def expert_column(cfg: ParallelConfig) -> str:
    """``ptdp plan``'s e column: e, with the dispatcher's initial at e > 1 (a: alltoall, g: allgather) and
    "/etp1" when the experts are not split over the tensor-parallel group."""
    e, etp = expert_sizes(cfg)
    dispatcher = cfg.moe_token_dispatcher_type
    tensor = "/etp1" if etp == 1 and cfg.tensor_model_parallel_size > 1 else ""
    return f"{e}{dispatcher[3 if dispatcher == 'allgather' else 0] if e > 1 else ''}{tensor}"


def expert_split_words(model: GPTSpec, cfg: ParallelConfig) -> str:
    """`` (the experts over e·etp·p = N)`` for ``ptdp plan``'s memory line; empty for a dense model."""
    if model.moe is None:
        return ""
    e, etp = expert_sizes(cfg)
    return f" (the experts over e·etp·p = {e * etp * cfg.pipeline_model_parallel_size})"


def expert_lines(model: GPTSpec, cfg: ParallelConfig, share: float) -> list[str]:
    """``ptdp plan``'s explanation of the chosen expert layout, whose token movement takes ``share`` of the
    iteration (none for a dense model)."""
    if model.moe is None:
        return []
    e, etp = expert_sizes(cfg)
    edp = expert_data_parallel_size(cfg)
    moe = model.moe
    return [f"e = {e} (etp = {etp}, edp = {edp}): each rank holds {moe.num_experts // e} of the {moe.num_experts} "
            f"experts{f', each 1/{etp} of its FFN' if etp > 1 else ''}; expert gradients and optimizer states over "
            f"the {edp} expert-data-parallel ranks; token {cfg.moe_token_dispatcher_type} "
            f"{share:.0%} of the iteration (docs/expert-parallel.md)"]
