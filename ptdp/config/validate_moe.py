"""``--moe-layer-freq`` parsing and the mixture-of-experts checks of ``ptdp.config.validate`` (``--num-experts``
and the ``--moe-*`` flags), pure: one actionable line per problem. The expert-parallel sizes are checked with
the parallel layout (:func:`expert_layout_errors`, the rules of MoE Parallel Folding, ``ptdp.parallel.
expert_dims``; here, without torch, so that ``ptdp plan`` applies them too)."""

from __future__ import annotations

import ast
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no runtime import: the models import moe_layer_pattern from here
    from ptdp.config.schema import Config, ModelConfig


def moe_layer_pattern(freq: str | int, num_layers: int) -> list[bool]:
    """``--moe-layer-freq``: N → layers 0, N, 2N, ... are MoE (Megatron's ``i % N == 0``); a list (or a list
    expression such as ``([1]*3+[0])*2``) gives one 0/1 per layer. ValueError naming the flag otherwise."""
    text = str(freq).strip()
    if re.fullmatch(r"\d+", text):
        n = int(text)
        if n < 1:
            raise ValueError(f"--moe-layer-freq must be a positive integer or a list, got {text}")
        return [i % n == 0 for i in range(num_layers)]
    if not re.fullmatch(r"[\[\]()0-9*+,\s]+", text):
        raise ValueError(f"--moe-layer-freq {text!r} is neither an integer nor a list such as '[1,0,1,0]'")
    try:
        pattern = eval(compile(ast.parse(text, mode="eval"), "<moe-layer-freq>", "eval"), {"__builtins__": {}})
    except Exception:
        raise ValueError(f"--moe-layer-freq {text!r} is neither an integer nor a list such as '[1,0,1,0]'") \
            from None
    if not isinstance(pattern, list) or any(v not in (0, 1) for v in pattern) or len(pattern) != num_layers:
        raise ValueError(f"--moe-layer-freq {text!r} must list one 0 or 1 per layer ({num_layers} layers)")
    return [bool(v) for v in pattern]


def moe_errors(config: Config) -> list[str]:
    """Every problem with the MoE flags of ``config`` (none while ``--num-experts`` is unset)."""
    moe, m = config.moe, config.model
    if moe.num_experts is None:
        return []
    if moe.num_experts < 1:
        return [f"--num-experts must be a positive integer, got {moe.num_experts}"]
    errors = []
    k = moe.moe_router_topk
    if not 1 <= k <= moe.num_experts:
        errors.append(f"--moe-router-topk {k} must be between 1 and --num-experts {moe.num_experts}")
    if moe.moe_ffn_hidden_size is not None and moe.moe_ffn_hidden_size < 1:
        errors.append(f"--moe-ffn-hidden-size must be a positive integer, got {moe.moe_ffn_hidden_size}")
    shared = moe.moe_shared_expert_intermediate_size
    if shared is not None and shared < 1:
        errors.append(f"--moe-shared-expert-intermediate-size must be a positive integer, got {shared}")
    if moe.moe_shared_expert_gate and not shared:
        errors.append("--moe-shared-expert-gate needs a shared expert: set --moe-shared-expert-intermediate-size")
    factor = moe.moe_expert_capacity_factor
    if factor is not None and factor <= 0:
        errors.append(f"--moe-expert-capacity-factor must be positive (or unset: dropless), got {factor}")
    if moe.moe_pad_expert_input_to_capacity and factor is None:
        errors.append("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor (dropless routing "
                      "has no capacity to pad to)")
    if moe.moe_aux_loss_coeff < 0 or (moe.moe_z_loss_coeff or 0.0) < 0:
        errors.append("--moe-aux-loss-coeff and --moe-z-loss-coeff must be >= 0")
    # --sequence-parallel: each TP rank routes its s/t tokens; ptdp.parallel.expert.apply supplies the reductions
    # (router grads summed over TP, the load-balancing loss over whole sequences: expert_aux.py).
    if m.num_layers > 0:
        try:
            moe_layer_pattern(moe.moe_layer_freq, m.num_layers)
        except ValueError as e:
            errors.append(str(e))
    return errors + _router_errors(config)


def _router_errors(config: Config) -> list[str]:
    """DeepSeek-V3's router flags: the score function, the expert bias, group-limited routing."""
    moe, errors = config.moe, []
    sigmoid = moe.moe_router_score_function == "sigmoid"
    if sigmoid and moe.moe_router_pre_softmax:
        errors.append("--moe-router-pre-softmax applies to the softmax score function; drop it with "
                      "--moe-router-score-function sigmoid")
    if moe.moe_router_enable_expert_bias and not sigmoid:
        errors.append("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (as in "
                      "Megatron-Core: the bias shifts sigmoid scores)")
    if moe.moe_router_bias_update_rate < 0:
        errors.append(f"--moe-router-bias-update-rate must be >= 0, got {moe.moe_router_bias_update_rate}")
    factor = moe.moe_router_topk_scaling_factor
    if factor is not None and not factor > 0:
        errors.append(f"--moe-router-topk-scaling-factor must be positive, got {factor}")
    groups, group_topk, e, k = moe.moe_router_num_groups, moe.moe_router_group_topk, moe.num_experts, moe.moe_router_topk
    if groups is None:
        if group_topk is not None:
            errors.append("--moe-router-group-topk needs --moe-router-num-groups (group-limited routing)")
        return errors
    if groups < 1 or e % groups:
        errors.append(f"--moe-router-num-groups {groups} must be positive and divide --num-experts {e}")
    elif group_topk is None or not 1 <= group_topk <= groups:
        errors.append(f"--moe-router-group-topk {group_topk} must be between 1 and --moe-router-num-groups "
                      f"{groups}: the groups each token may use")
    elif not group_topk <= k <= group_topk * (e // groups) or k // group_topk > e // groups:
        errors.append(f"--moe-router-topk {k} must be between --moe-router-group-topk {group_topk} and the "
                      f"{group_topk * (e // groups)} experts of the chosen groups (a group is ranked by its top "
                      "k/group-topk scores)")
    return errors


def deepseek_errors(config: Config) -> list[str]:
    """Multi-latent attention, YaRN and multi-token prediction: their shapes, and the one layout
    they do not run in (MTP under vocabulary and context parallelism at once)."""
    m = config.model
    errors = []
    if m.multi_latent_attention:
        for flag, value in (("--kv-lora-rank", m.kv_lora_rank), ("--qk-head-dim", m.qk_head_dim),
                            ("--v-head-dim", m.v_head_dim), ("--q-lora-rank", m.q_lora_rank or 1)):
            if value < 1:
                errors.append(f"{flag} must be a positive integer, got {value}")
        if m.qk_pos_emb_head_dim < 2 or m.qk_pos_emb_head_dim % 2:
            errors.append(f"--qk-pos-emb-head-dim must be a positive even number (RoPE rotates pairs), got "
                          f"{m.qk_pos_emb_head_dim}")
        if m.position_embedding_type != "rope" or m.group_query_attention or m.use_rope_scaling \
                or m.rotary_percent != 1.0:
            errors.append("--multi-latent-attention needs --position-embedding-type rope (for its decoupled RoPE "
                          "part), without --group-query-attention, --use-rope-scaling or --rotary-percent")
    if rope_type(m) == "yarn":
        if not m.multi_latent_attention and (m.position_embedding_type != "rope" or m.use_rope_scaling):
            errors.append("--rope-type yarn scales the rotary embedding: it needs --position-embedding-type rope "
                          "(or --multi-latent-attention), without --use-rope-scaling")
        if not (m.rotary_scaling_factor > 0 and m.original_max_position_embeddings > 0 and m.beta_fast > 0
                and m.beta_slow > 0):
            errors.append("--rotary-scaling-factor, --original-max-position-embeddings, --beta-fast and "
                          "--beta-slow must be positive")
    if m.mtp_num_layers:
        errors += _mtp_errors(config)
    elif m.mtp_num_layers is not None and m.mtp_num_layers < 0:
        errors.append(f"--mtp-num-layers must be >= 0 (0: none), got {m.mtp_num_layers}")
    return errors


def rope_type(m: ModelConfig) -> str:
    """``--rope-type``, defaulting as Megatron-Core does: yarn with multi-latent attention, else rope."""
    return m.rope_type or ("yarn" if m.multi_latent_attention else "rope")


def _mtp_errors(config: Config) -> list[str]:
    m, par = config.model, config.parallel
    d = m.mtp_num_layers
    if not 1 <= d < m.seq_length:
        return [f"--mtp-num-layers must be between 1 and --seq-length - 1 = {m.seq_length - 1}, got {d}"]
    errors = []
    if m.mtp_loss_scaling_factor < 0:
        errors.append(f"--mtp-loss-scaling-factor must be >= 0, got {m.mtp_loss_scaling_factor}")
    if m.position_embedding_type != "rope":
        errors.append("--mtp-num-layers needs --position-embedding-type rope (the modules embed tokens "
                      "without learned positions)")
    packed = [flag for flag, on in (("--reset-position-ids", config.data.reset_position_ids),
                                    ("--reset-attention-mask", config.data.reset_attention_mask),
                                    ("--eod-mask-loss", config.data.eod_mask_loss),
                                    ("--sft", config.data.sft)) if on]
    if packed:  # the modules' targets t_{i+k+1} would cross document ends (Megatron rolls them per document)
        errors.append(f"--mtp-num-layers with {packed[0]} is not supported (the modules' shifted targets would "
                      "cross document boundaries); drop one of them")
    if par.enable_vocab_parallel and par.context_parallel_size > 1:
        errors.append("--mtp-num-layers with --enable-vocab-parallel and --context-parallel-size "
                      f"{par.context_parallel_size} is not supported (the vocabulary passes would embed tokens "
                      "another CP rank holds); drop one of them")
    return errors


def expert_tensor_size(etp: int | None, t: int) -> int:
    """``--expert-tensor-parallel-size``, defaulting to t as Megatron-Core does."""
    return t if etp is None else etp


def expert_layout_errors(*, world_size: int, t: int, c: int, p: int, e: int, etp: int | None,
                         num_experts: int | None, sequence_parallel: bool, tokens_per_rank: int) -> list[str]:
    """Every problem with the expert layout, one line each (pure: no process group needed).

    ``tokens_per_rank`` is b·s/c, the tokens one rank holds between layers without sequence parallelism;
    with ``etp = 1`` and t > 1 each tensor-parallel rank routes its own 1/t of them (they are replicated over
    the TP group otherwise), so t must divide it.
    """
    errors: list[str] = []
    etp_ = expert_tensor_size(etp, t)
    if e <= 0 or etp_ <= 0:
        return [f"--expert-model-parallel-size {e} and --expert-tensor-parallel-size {etp_} must be positive"]
    if num_experts is None:
        if e > 1:
            errors.append(f"--expert-model-parallel-size {e} needs a mixture-of-experts model (--num-experts)")
        return errors
    if num_experts % e:
        errors.append(f"--expert-model-parallel-size {e} does not divide --num-experts {num_experts}; each "
                      "expert-parallel rank needs the same number of experts")
    if world_size % (etp_ * e * p):
        errors.append(f"world size {world_size} is not divisible by --expert-tensor-parallel-size x "
                      f"--expert-model-parallel-size x --pipeline-model-parallel-size = {etp_}x{e}x{p}: each "
                      f"pipeline stage's {world_size // p if world_size % p == 0 else '?'} ranks must hold "
                      "whole expert groups")
    if etp_ > 1 and etp_ != t:  # with --sequence-parallel the dispatcher gathers the tokens over it
        errors.append(f"--expert-tensor-parallel-size {etp_} cannot fold onto the attention layout (only 1 or "
                      f"t = {t} fold: the expert-tensor group must be attention's tensor-parallel group); use "
                      "--expert-tensor-parallel-size 1: e then spans the tensor- and context-parallel ranks")
    elif etp_ == 1 and t > 1 and not sequence_parallel and tokens_per_rank % t:
        errors.append(f"--micro-batch-size x --seq-length / c = {tokens_per_rank} tokens are not divisible by "
                      f"--tensor-model-parallel-size {t}: each tensor-parallel rank routes 1/t of them to the "
                      "experts")
    return errors
