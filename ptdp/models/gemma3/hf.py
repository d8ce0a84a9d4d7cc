"""Hugging Face ``Gemma3ForCausalLM`` (``model_type`` gemma3_text) import and export.

The Llama parts (the fused QKV, the [gate; up] fc1, the padded vocabulary) convert through
``ptdp.models.llama.hf``; Gemma 3 adds, by ptdp's flags:

- ``self_attn.q_norm``/``k_norm`` (``[head_dim]``): ``--qk-layernorm``; every norm is zero-centred,
  x·(1 + w) in fp32 (``--apply-layernorm-1p``);
- four norms per layer (``--sandwich-norm``): HF's ``input_layernorm`` → ``input_layernorm``,
  ``post_attention_layernorm`` (after the attention) → ``post_self_attn_layernorm``,
  ``pre_feedforward_layernorm`` → ``post_attention_layernorm`` (ptdp's pre-MLP norm, Llama's name),
  ``post_feedforward_layernorm`` → ``post_mlp_layernorm``;
- ``layer_types`` + ``sliding_window``: ``--window-size`` and ``--window-attn-skip-freq`` (N when the pattern is
  every N-th layer global, else a list); the rotary bases per layer kind: ``--rotary-base`` (full) and
  ``--local-rotary-base`` (sliding);
- ``hidden_activation`` gelu_pytorch_tanh: ``--geglu``; ``query_pre_attn_scalar``: ``--softmax-scale``;
  the √h embedding scale: ``--scale-embedding``.

``final_logit_softcapping`` (Gemma 2's soft-cap of the logits, null: none): ``--final-logit-softcapping``.
``attn_logit_softcapping`` is read and dropped: HF's Gemma 3 keeps it in its config but its attention never
applies it (Gemma 2's does), so the imported model computes HF's logits without it; export refuses a model
with ``--attn-logit-softcapping`` (HF's Gemma 3 would silently compute another model).

Refused with one line naming the field: a soft-cap not above 0, rope scaling (``rope_scaling``, a ``rope_type`` other than default: the 4B-27B checkpoints' linear factor 8),
``use_bidirectional_attention``, ``attention_bias``, another ``hidden_activation``, another layer kind.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ptdp.config import ConfigError, ModelConfig, MoEConfig
from ptdp.config.validate_window import window_layers
from ptdp.models.llama import hf as llama

if TYPE_CHECKING:
    import torch

P = llama.HF_PREFIX
_LAYER = {"attention.q_layernorm.weight": "self_attn.q_norm.weight",
          "attention.k_layernorm.weight": "self_attn.k_norm.weight",
          "post_self_attn_layernorm.weight": "post_attention_layernorm.weight",
          "post_attention_layernorm.weight": "pre_feedforward_layernorm.weight",
          "post_mlp_layernorm.weight": "post_feedforward_layernorm.weight"}
SLIDING, FULL = "sliding_attention", "full_attention"


class Gemma3ConversionError(ConfigError):
    """Something in a Gemma 3 model or its files that ptdp cannot compute exactly; one line."""


def _plain(cfg: ModelConfig) -> ModelConfig:
    """The Llama the Gemma 3 flags sit on (for the shared Llama conversion)."""
    return dataclasses.replace(cfg, qk_layernorm=False, window_size=None, window_attn_skip_freq=None,
                               local_rotary_base=None, sandwich_norm=False, apply_layernorm_1p=False,
                               scale_embedding=False, geglu=False, swiglu=True, softmax_scale=None)


def is_gemma3(cfg: ModelConfig, moe: MoEConfig) -> bool:
    """Whether HF's ``Gemma3ForCausalLM`` computes exactly this model (the 1 + w norms, GeGLU, q/k and sandwich
    norms, scaled embeddings, a given softmax scale and tied embeddings are what make it Gemma 3)."""
    return (cfg.qk_layernorm and cfg.sandwich_norm and cfg.apply_layernorm_1p and cfg.scale_embedding and cfg.geglu
            and not cfg.swiglu and cfg.softmax_scale is not None and not moe.num_experts
            and llama.is_llama(_plain(cfg)))


def export_problem(cfg: ModelConfig, moe: MoEConfig) -> str | None:
    return None if cfg.tied_embeddings else "Gemma 3 export needs tied embeddings (HF's Gemma3ForCausalLM ties them)"


def _rope(hf_config: dict) -> tuple[float, float]:
    """(global base, local base) from a transformers 5.x ``rope_parameters`` per layer kind or 4.x's
    ``rope_theta``/``rope_local_base_freq``; refuses any rope scaling."""
    if hf_config.get("rope_scaling"):
        raise Gemma3ConversionError(f"--in: config.json has rope_scaling={hf_config['rope_scaling']}; ptdp's "
                                    "Gemma 3 has no rope scaling")
    params = hf_config.get("rope_parameters") or {}
    kinds = params if any(k in params for k in (SLIDING, FULL)) else {FULL: params}
    for kind, p in kinds.items():
        if (p or {}).get("rope_type", "default") != "default":
            raise Gemma3ConversionError(f"--in: config.json's rope_parameters[{kind!r}] has rope_type "
                                        f"{p['rope_type']!r}; ptdp's Gemma 3 has no rope scaling")
    full = (kinds.get(FULL) or {}).get("rope_theta", hf_config.get("rope_theta", 1_000_000.0))
    local = (kinds.get(SLIDING) or {}).get("rope_theta", hf_config.get("rope_local_base_freq", 10_000.0))
    return float(full), float(local)


def window_pattern(kinds: list[str]) -> str | None:
    """``--window-attn-skip-freq`` for HF's ``layer_types``: None (all slide), N, or a list (1: sliding)."""
    sliding = [int(kind == SLIDING) for kind in kinds]
    if all(sliding):
        return None
    n = sliding.index(0) + 1
    if sliding == [int((i + 1) % n != 0) for i in range(len(kinds))]:
        return str(n)
    return str(sliding).replace(" ", "")


def _config(hf_config: dict) -> ModelConfig:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf_config.get(key) is not None and not float(hf_config[key]) > 0:
            raise Gemma3ConversionError(f"--in: config.json has {key}={hf_config[key]}; a soft-cap must be > 0")
    for key in ("use_bidirectional_attention", "attention_bias"):
        if hf_config.get(key):
            raise Gemma3ConversionError(f"--in: config.json has {key}=true; ptdp's Gemma 3 is causal, without biases")
    act = hf_config.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise Gemma3ConversionError(f"--in: config.json has hidden_activation={act!r}; ptdp's GeGLU is "
                                    "'gelu_pytorch_tanh'")
    n = hf_config["num_hidden_layers"]
    kinds = hf_config.get("layer_types") or [SLIDING if (i + 1) % hf_config.get("sliding_window_pattern", 6) else FULL
                                             for i in range(n)]
    odd = sorted(set(kinds) - {SLIDING, FULL})
    if odd or len(kinds) != n:
        raise Gemma3ConversionError(f"--in: config.json has layer_types {odd or kinds}; ptdp reads one "
                                    f"sliding_attention or full_attention per layer ({n} layers)")
    full, local = _rope(hf_config)
    skip = ("sliding_window", "use_sliding_window", "layer_types", "rope_parameters", "rope_scaling", "rope_theta",
            "rope_local_base_freq", "hidden_activation", "hidden_act", "attn_logit_softcapping",
            "final_logit_softcapping")
    cfg = llama.model_config_from_hf({**{k: v for k, v in hf_config.items() if k not in skip}, "rope_theta": full})
    sliding = SLIDING in kinds
    window = hf_config.get("sliding_window") if sliding else None
    if sliding and not window:
        raise Gemma3ConversionError("--in: config.json has sliding_attention layers and no sliding_window")
    return dataclasses.replace(
        cfg, swiglu=False, geglu=True, qk_layernorm=True, sandwich_norm=True, apply_layernorm_1p=True,
        scale_embedding=True, kv_channels=hf_config.get("head_dim") or cfg.head_dim,
        softmax_scale=float(hf_config.get("query_pre_attn_scalar", 256)) ** -0.5,
        window_size=window, window_attn_skip_freq=window_pattern(kinds) if sliding else None,
        local_rotary_base=local if sliding else None,
        final_logit_softcapping=_cap(hf_config.get("final_logit_softcapping")),
        untie_embeddings_and_output_weights=not hf_config.get("tie_word_embeddings", True))


def gemma3_model(hf_config: dict) -> tuple[ModelConfig, MoEConfig]:
    """The model flags of a Gemma 3 ``config.json``."""
    return _config(hf_config), MoEConfig()


def gemma3_recipes(cfg: ModelConfig, moe: MoEConfig, padded_vocab: int) -> dict:
    """Per ptdp parameter, its recipe over ``Gemma3ForCausalLM`` tensors (``ptdp.models.hf_recipe``): Llama's
    (the fused QKV, the [gate; up] fc1, the padded, tied embedding) and the four norms per layer and the q/k
    norms renamed. The (1 + w) norms need no change of values: HF stores w, as ptdp's
    ``--apply-layernorm-1p`` does. Import, ``--load HF_DIR`` and export all run this one mapping."""
    from ptdp.models.hf_recipe import Take

    return {**llama.hf_recipes(_plain(cfg), padded_vocab),
            **{f"layers.{i}.{ours}": Take(f"{P}layers.{i}.{theirs}") for i in range(cfg.num_layers)
               for ours, theirs in _LAYER.items()}}


def _cap(value: Any) -> float | None:
    """A soft-cap of config.json (Gemma 2's ``attn_logit_softcapping`` / ``final_logit_softcapping``)."""
    return None if value is None else float(value)


def read_gemma3(hf_config: dict, hf: dict[str, torch.Tensor]) -> tuple[ModelConfig, MoEConfig, dict]:
    """``ptdp import``: :func:`gemma3_recipes` evaluated whole."""
    cfg, moe = gemma3_model(hf_config)
    return cfg, moe, llama.import_state(lambda padded: gemma3_recipes(cfg, moe, padded), hf, cfg,
                                        lambda e: Gemma3ConversionError(f"--in: {e}; is it a Gemma 3 model?"))


def write_gemma3(tensors: dict[str, torch.Tensor], cfg: ModelConfig, moe: MoEConfig) -> dict[str, torch.Tensor]:
    out = llama.to_hf_state(tensors, _plain(cfg))
    for i in range(cfg.num_layers):
        for ours, theirs in _LAYER.items():
            out[f"{P}layers.{i}.{theirs}"] = tensors[f"layers.{i}.{ours}"].detach().float().contiguous()
    return out


def gemma3_config(cfg: ModelConfig, moe: MoEConfig, bos: int | None, eos: int | None) -> dict[str, Any]:
    """``Gemma3TextConfig`` keyword arguments that make HF compute what ptdp computes."""
    if cfg.attn_logit_softcapping is not None:
        raise Gemma3ConversionError("--attn-logit-softcapping: HF's Gemma 3 does not apply attention soft-capping; "
                                    "this model cannot be exported as Gemma3ForCausalLM")
    kwargs = llama.hf_config_kwargs(_plain(cfg), bos, eos)
    for key in ("hidden_act", "mlp_bias", "rope_theta", "rope_scaling"):
        kwargs.pop(key)
    kinds = [FULL if w is None else SLIDING for w in window_layers(cfg)]
    scalar = cfg.softmax_scale ** -2
    local = cfg.local_rotary_base or cfg.rotary_base
    return {**kwargs, "hidden_activation": "gelu_pytorch_tanh", "layer_types": kinds,
            "sliding_window": cfg.window_size, "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar))
            < 1e-6 else scalar, "attn_logit_softcapping": None,
            "final_logit_softcapping": cfg.final_logit_softcapping,
            "use_bidirectional_attention": False, "pad_token_id": None,
            "rope_parameters": {FULL: {"rope_type": "default", "rope_theta": cfg.rotary_base},
                                SLIDING: {"rope_type": "default", "rope_theta": local}},
            "architectures": ["Gemma3ForCausalLM"]}
