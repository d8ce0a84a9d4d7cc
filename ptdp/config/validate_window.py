"""Sliding-window attention and the other Gemma 3 and GPT-OSS flags (``ModelConfig``): which layers slide, and
the combinations ptdp refuses (one line each) instead of computing something else.

``window_layers`` is Megatron's ``is_layer_window_attention``: with ``--window-attn-skip-freq N`` the layers
whose 1-based number is a multiple of N attend to the whole context, with a list the entry 1 marks a sliding
layer; unset, every layer slides. Nothing here imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ptdp.config.validate_moe import moe_layer_pattern

if TYPE_CHECKING:
    from ptdp.config.schema import Config, ModelConfig


def window_layers(cfg: ModelConfig) -> list[int | None]:
    """Per layer its window w (a sliding layer) or None (the whole causal context). ValueError naming the
    flag for a pattern it cannot read."""
    if not cfg.window_size:
        return [None] * cfg.num_layers
    freq = cfg.window_attn_skip_freq
    if freq is None:
        return [cfg.window_size] * cfg.num_layers
    text = str(freq).strip()
    if text.isdigit():
        n = int(text)
        if n < 1:
            raise ValueError(f"--window-attn-skip-freq must be a positive integer or a list, got {text}")
        return [None if (i + 1) % n == 0 else cfg.window_size for i in range(cfg.num_layers)]
    try:  # the list form, read as --moe-layer-freq's (a 1 per sliding layer)
        sliding = moe_layer_pattern(text, cfg.num_layers)
    except ValueError as e:
        raise ValueError(str(e).replace("--moe-layer-freq", "--window-attn-skip-freq")) from None
    return [cfg.window_size if s else None for s in sliding]


def window_errors(config: Config) -> list[str]:
    """The Gemma 3 flags against each other and against the parallelisms and packing."""
    m = config.model
    errors = _gpt_oss_errors(config) + _softcap_errors(config)
    if sum((m.swiglu, m.geglu, m.quick_geglu)) > 1:
        errors.append("--swiglu, --geglu and --quick-geglu are three MLPs; give one")
    if m.softmax_scale is not None and not m.softmax_scale > 0:
        errors.append(f"--softmax-scale must be > 0, got {m.softmax_scale}")
    if m.local_rotary_base is not None and not m.local_rotary_base > 0:
        errors.append(f"--local-rotary-base must be > 0, got {m.local_rotary_base}")
    if m.apply_layernorm_1p and m.normalization != "RMSNorm":
        errors.append("--apply-layernorm-1p needs --normalization RMSNorm (ptdp's zero-centred norm is Gemma's RMSNorm)")
    if m.window_size is None:
        if m.window_attn_skip_freq is not None:
            errors.append("--window-attn-skip-freq needs --window-size")
        return errors
    if m.window_size < 1:
        errors.append(f"--window-size must be a positive integer, got {m.window_size}")
    try:
        window_layers(m)
    except ValueError as e:
        errors.append(str(e))
    if m.multi_latent_attention:
        errors.append("--window-size with --multi-latent-attention is not supported")
    return errors


def _softcap_errors(config: Config) -> list[str]:
    """Gemma 2's soft-capping: the attention cores (one process and context-parallel) and the output logits
    compute it, as do the vocabulary-parallel output passes; multi-latent attention does not."""
    m = config.model
    errors = []
    for flag, cap in (("--attn-logit-softcapping", m.attn_logit_softcapping),
                      ("--final-logit-softcapping", m.final_logit_softcapping)):
        if cap is not None and not cap > 0:
            errors.append(f"{flag} must be > 0, got {cap}")
    if m.attn_logit_softcapping is not None:
        if m.multi_latent_attention:
            errors.append("--attn-logit-softcapping with --multi-latent-attention is not supported")
    return errors


def _gpt_oss_errors(config: Config) -> list[str]:
    """GPT-OSS's flags: the attention sinks, the clamped quick-GeGLU, the experts' biases."""
    m, par = config.model, config.parallel
    errors = []
    if (m.glu_linear_offset or m.activation_func_clamp_value is not None) and not m.gated_mlp:
        errors.append("--glu-linear-offset and --activation-func-clamp-value act on a gated MLP; add --swiglu, "
                      "--geglu or --quick-geglu")
    if m.openai_gelu and m.gated_mlp:
        errors.append("--openai-gelu picks the plain GeLU MLP's tanh form; a gated MLP (--swiglu, --geglu, "
                      "--quick-geglu) has its own activation: drop the flag")
    if m.activation_func_clamp_value is not None and not m.activation_func_clamp_value > 0:
        errors.append(f"--activation-func-clamp-value must be > 0, got {m.activation_func_clamp_value}")
    if m.softmax_type != "vanilla":
        if m.multi_latent_attention:
            errors.append(f"--softmax-type {m.softmax_type} with --multi-latent-attention is not supported")
    if config.moe.moe_linear_bias:
        if not config.moe.num_experts:
            errors.append("--moe-linear-bias needs a mixture of experts (--num-experts)")
        etp = par.expert_tensor_parallel_size
        if (par.tensor_model_parallel_size if etp is None else etp) > 1:
            errors.append("--moe-linear-bias with --expert-tensor-parallel-size > 1 is not supported (fc2's bias "
                          "would be added once per expert-tensor rank); use --expert-tensor-parallel-size 1")
    return errors
