"""Hugging Face ``GptOssForCausalLM`` (``model_type`` gpt_oss) import and export.

Per ptdp parameter a recipe over HF tensor names (``ptdp.models.hf_recipe``: :func:`gpt_oss_recipes`) that
import evaluates whole, ``ptdp train --load HF_DIR`` over each rank's box and export backwards. The Llama
parts (embedding, untied head, RMSNorms, the fused QKV and its bias, cut along the same rows) are
``ptdp.models.llama.hf``'s recipes. GPT-OSS adds, by ptdp's flags:

- ``self_attn.sinks [a]`` → ``attention.sinks.weight`` (``--softmax-type learnable``); ``attention_bias``: biases
  on q, k, v and o (Megatron's default biases: no ``--disable-bias-linear``);
- ``layer_types`` + ``sliding_window``: ``--window-size`` and ``--window-attn-skip-freq`` (GPT-OSS: every
  other layer slides, w = 128), read as Gemma 3's;
- YaRN (``rope_parameters`` rope_type yarn): ``--rope-type yarn``, ``--rotary-scaling-factor``,
  ``--original-max-position-embeddings``, ``--beta-fast``/``--beta-slow``; ``truncate: false`` is
  ``--no-yarn-correction-range-round-to-int``; the tables' factor is mscale(factor), HF's default;
- every layer a mixture of experts with biases (``--moe-linear-bias``): ``mlp.router.weight``/``bias``,
  top-k of the logits then a softmax over the k (ptdp's default router); ``experts.gate_up_proj [E, h, 2f]``
  with the gate and up columns *interleaved* (gate = even columns) and its bias ``[E, 2f]`` likewise →
  ``experts.fc1_weight [E, 2, f, h]`` / ``fc1_bias [E, 2, f]`` (the recipe ops ``Transpose`` of each expert's
  matrix and ``Interleaved``: a rank's rows f read only their columns); ``down_proj [E, f, h]`` and its bias
  → ``fc2_weight [E, h, f]`` / ``fc2_bias``; the published checkpoints' MXFP4 ``*_blocks``/``*_scales``
  are dequantized where the unquantized tensor is absent (``OneOf`` … ``MXFP4``: only the rows a rank
  reads, ``ptdp.models.mxfp4``); export writes the unquantized fp32 tensors;
- the experts' activation: ``(up + 1) · g·sigmoid(α·g)`` after clamping g to ≤ limit and up to ±limit:
  ``--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value limit`` (α = 1.702 only).

Refused with one line naming the field: another ``swiglu_alpha``, a rope type other than default/yarn or
YaRN's attention_factor/mscale overrides, another layer kind.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ptdp.config import ConfigError, ModelConfig, MoEConfig
from ptdp.config.validate_window import window_layers
from ptdp.models.gemma3.hf import FULL, SLIDING, window_pattern
from ptdp.models.llama import hf as llama

P = llama.HF_PREFIX
_EXPERTS = ("gate_up_proj", "down_proj")


class GptOssConversionError(ConfigError):
    """Something in a GPT-OSS model or its files that ptdp cannot compute exactly; one line."""


def _plain(cfg: ModelConfig) -> ModelConfig:
    """The Llama the GPT-OSS flags sit on (for the shared Llama conversion)."""
    return dataclasses.replace(cfg, window_size=None, window_attn_skip_freq=None, quick_geglu=False, swiglu=True,
                               glu_linear_offset=0.0, activation_func_clamp_value=None, softmax_type="vanilla",
                               disable_bias_linear=True, rope_type=None, rotary_scaling_factor=1.0,
                               yarn_correction_range_round_to_int=True)


def is_gpt_oss(cfg: ModelConfig, moe: MoEConfig) -> bool:
    """Whether HF's ``GptOssForCausalLM`` computes exactly this model: sinks, the clamped quick-GeGLU with its
    +1, experts with biases in every layer and the Mixtral router."""
    from ptdp.models.moe import moe_layer_pattern

    return (cfg.quick_geglu and cfg.glu_linear_offset == 1.0 and cfg.softmax_type == "learnable"
            and bool(moe.num_experts) and moe.moe_linear_bias and all(moe_layer_pattern(moe.moe_layer_freq,
                                                                                         cfg.num_layers))
            and not moe.moe_shared_expert_intermediate_size and not moe.moe_router_pre_softmax
            and moe.moe_router_score_function == "softmax" and not moe.moe_router_enable_expert_bias
            and not moe.moe_router_num_groups and not moe.moe_router_topk_scaling_factor
            and (cfg.add_bias_linear or not cfg.add_qkv_bias) and cfg.mscale == 1.0 and cfg.mscale_all_dim == 0.0
            and llama.is_llama(_plain(cfg)))


def _rope(hf_config: dict) -> dict[str, Any]:
    """ptdp's rope flags for HF's ``rope_parameters`` (default or yarn)."""
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf_config.get("rope_theta", 150000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {"rotary_base": theta, "rope_type": "rope"}
    if kind != "yarn":
        raise GptOssConversionError(f"--in: config.json has rope_type {kind!r}; ptdp's GPT-OSS supports default "
                                    "and 'yarn'")
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        if params.get(key) is not None:
            raise GptOssConversionError(f"--in: config.json's rope_parameters set {key}; ptdp's GPT-OSS uses YaRN's "
                                        "default mscale(factor)")
    return {"rotary_base": theta, "rope_type": "yarn", "rotary_scaling_factor": float(params["factor"]),
            "original_max_position_embeddings": int(params["original_max_position_embeddings"]),
            "beta_fast": float(params.get("beta_fast") or 32.0), "beta_slow": float(params.get("beta_slow") or 1.0),
            "yarn_correction_range_round_to_int": bool(params.get("truncate", True))}


def _config(hf_config: dict) -> tuple[ModelConfig, MoEConfig]:
    # imported here: the family registry, which the parsers read, stays without torch
    from ptdp.models.glu import QUICK_GELU_ALPHA

    alpha = float(hf_config.get("swiglu_alpha", QUICK_GELU_ALPHA))
    if alpha != QUICK_GELU_ALPHA:
        raise GptOssConversionError(f"--in: config.json has swiglu_alpha={alpha}; ptdp's quick-GeGLU uses "
                                    f"{QUICK_GELU_ALPHA}")
    n = hf_config["num_hidden_layers"]
    kinds = hf_config.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    odd = sorted(set(kinds) - {SLIDING, FULL})
    if odd or len(kinds) != n:
        raise GptOssConversionError(f"--in: config.json has layer_types {odd or kinds}; ptdp reads one "
                                    f"sliding_attention or full_attention per layer ({n} layers)")
    sliding = SLIDING in kinds
    window = hf_config.get("sliding_window") if sliding else None
    if sliding and not window:
        raise GptOssConversionError("--in: config.json has sliding_attention layers and no sliding_window")
    skip = ("sliding_window", "layer_types", "rope_parameters", "rope_scaling", "rope_theta", "attention_bias",
            "hidden_act")
    cfg = llama.model_config_from_hf({k: v for k, v in hf_config.items() if k not in skip})
    limit = hf_config.get("swiglu_limit", 7.0)
    cfg = dataclasses.replace(
        cfg, swiglu=False, quick_geglu=True, glu_linear_offset=1.0,
        activation_func_clamp_value=None if limit is None else float(limit), softmax_type="learnable",
        disable_bias_linear=not hf_config.get("attention_bias", True), kv_channels=hf_config.get("head_dim"),
        window_size=window, window_attn_skip_freq=window_pattern(kinds) if sliding else None,
        untie_embeddings_and_output_weights=not hf_config.get("tie_word_embeddings", False), **_rope(hf_config))
    moe = MoEConfig(num_experts=hf_config["num_local_experts"], moe_router_topk=hf_config["num_experts_per_tok"],
                    moe_ffn_hidden_size=hf_config["intermediate_size"], moe_linear_bias=True)
    return cfg, moe


def gpt_oss_recipes(cfg: ModelConfig, moe: MoEConfig, padded_vocab: int) -> dict:
    """Per ptdp parameter, its recipe over ``GptOssForCausalLM`` tensors: Llama's (without the MLP) and the
    QKV bias cut like the QKV weight; the sinks, router and expert biases taken as they are; each expert's
    ``gate_up_proj [h, 2f]`` transposed and its interleaved gate/up columns viewed as ``[2, f]``, from the
    unquantized tensor or else from its MXFP4 blocks and scales (rows ``2f`` already, no transpose)."""
    from ptdp.models.hf_recipe import MXFP4, Interleaved, OneOf, Take, Transpose

    out = llama.hf_recipes(_plain(cfg), padded_vocab)
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}.", f"{P}layers.{i}."
        del out[ours + "mlp.fc1.weight"], out[ours + "mlp.fc2.weight"]
        if cfg.add_bias_linear:
            out[ours + "attention.qkv.bias"] = llama.qkv_recipe(cfg, theirs, "bias")
            out[ours + "attention.proj.bias"] = Take(theirs + "self_attn.o_proj.bias")
        out[ours + "attention.sinks.weight"] = Take(theirs + "self_attn.sinks")
        out[ours + "mlp.router.weight"] = Take(theirs + "mlp.router.weight")
        out[ours + "mlp.router.bias"] = Take(theirs + "mlp.router.bias")
        gate_up, down = (f"{theirs}mlp.experts.{x}" for x in _EXPERTS)
        out[ours + "mlp.experts.fc1_weight"] = Interleaved(OneOf((
            Transpose(Take(gate_up), (1, 2)), MXFP4(gate_up + "_blocks", gate_up + "_scales"))), 2, dim=1)
        out[ours + "mlp.experts.fc1_bias"] = Interleaved(Take(gate_up + "_bias"), 2, dim=1)
        out[ours + "mlp.experts.fc2_weight"] = OneOf((Transpose(Take(down), (1, 2)),
                                                      MXFP4(down + "_blocks", down + "_scales")))
        out[ours + "mlp.experts.fc2_bias"] = Take(down + "_bias")
    return out


def gpt_oss_model(hf_config: dict) -> tuple[ModelConfig, MoEConfig]:
    """ptdp's model and MoE flags for a GPT-OSS ``config.json`` (``ptdp train --load HF_DIR``)."""
    return _config(hf_config)


# ``ptdp import``: the recipes evaluated whole; the whole-model export (unquantized): run backwards.
read_gpt_oss = llama.recipe_read(_config, gpt_oss_recipes,
                                 lambda e: GptOssConversionError(f"--in: {e}; is it a GPT-OSS model?"))
write_gpt_oss = llama.recipe_write(gpt_oss_recipes)


def gpt_oss_config(cfg: ModelConfig, moe: MoEConfig, bos: int | None, eos: int | None) -> dict[str, Any]:
    """``GptOssConfig`` keyword arguments that make HF compute what ptdp computes."""
    from ptdp.models.glu import QUICK_GELU_ALPHA
    kwargs = llama.hf_config_kwargs(_plain(cfg), bos, eos)
    for key in ("mlp_bias", "rope_theta", "rope_scaling"):
        kwargs.pop(key)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_type == "yarn":
        rope.update(rope_type="yarn", factor=cfg.rotary_scaling_factor, beta_fast=cfg.beta_fast,
                    beta_slow=cfg.beta_slow, truncate=cfg.yarn_correction_range_round_to_int,
                    original_max_position_embeddings=cfg.original_max_position_embeddings)
    kinds = [FULL if w is None else SLIDING for w in window_layers(cfg)]
    return {**kwargs, "intermediate_size": moe.moe_ffn_hidden_size or cfg.ffn_size,
            "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.moe_router_topk,
            "attention_bias": cfg.add_bias_linear, "layer_types": kinds, "sliding_window": cfg.window_size,
            "swiglu_limit": cfg.activation_func_clamp_value, "swiglu_alpha": QUICK_GELU_ALPHA,
            "rope_parameters": rope, "router_aux_loss_coef": moe.moe_aux_loss_coeff, "pad_token_id": None,
            "architectures": ["GptOssForCausalLM"]}
