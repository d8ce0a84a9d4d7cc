"""Hugging Face ``Qwen3ForCausalLM`` and ``Qwen3MoeForCausalLM`` import and export.

Qwen3 is the Llama architecture (``ptdp.models.llama.hf`` converts the shared parts: the fused QKV, the
gate/up MLP, the padded vocabulary) with three differences:

- a per-head RMSNorm of the queries and of the keys (``self_attn.q_norm``/``k_norm``, ``[head_dim]``),
  applied before the rotary embedding: ``--qk-layernorm`` (``attention.q_layernorm``/``k_layernorm``);
- ``head_dim`` apart from hidden/heads (``--kv-channels``), e.g. 128 with h = 1024 and 16 heads;
- Qwen3-MoE: Mixtral-style experts under ``mlp`` (``ptdp.models.mixtral.hf`` reads either expert layout),
  no shared expert, dense layers where ``mlp_only_layers``/``decoder_sparse_step`` say (a
  ``--moe-layer-freq`` list), and the top-k weights renormalised only with ``norm_topk_prob`` (else
  ``--moe-router-pre-softmax``).

Sliding windows (``use_sliding_window``) and attention biases are refused with one line naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ptdp.config import ConfigError, ModelConfig, MoEConfig
from ptdp.models.llama import hf as llama
from ptdp.models.mixtral import hf as mixtral

if TYPE_CHECKING:
    import torch

P = llama.HF_PREFIX
_NORMS = {"attention.q_layernorm.weight": "self_attn.q_norm.weight",
          "attention.k_layernorm.weight": "self_attn.k_norm.weight"}


class Qwen3ConversionError(ConfigError):
    """Something in a Qwen3 model or its files that ptdp cannot compute exactly; one line."""


def is_qwen3(cfg: ModelConfig, moe: MoEConfig) -> bool:
    """Whether HF's ``Qwen3ForCausalLM`` computes exactly this model."""
    return cfg.qk_layernorm and not moe.num_experts and llama.is_llama(dataclasses.replace(cfg, qk_layernorm=False))


def is_qwen3_moe(cfg: ModelConfig, moe: MoEConfig) -> bool:
    """Whether HF's ``Qwen3MoeForCausalLM`` computes exactly this model: Qwen3 attention, softmax-routed
    experts without a shared expert, group-limited routing, expert bias or scaling."""
    return (cfg.qk_layernorm and bool(moe.num_experts) and llama.is_llama(dataclasses.replace(cfg, qk_layernorm=False))
            and not moe.moe_shared_expert_intermediate_size and moe.moe_router_score_function == "softmax"
            and not moe.moe_router_enable_expert_bias and not moe.moe_router_num_groups
            and not moe.moe_router_topk_scaling_factor)


def _check(hf_config: dict) -> dict:
    """The config without the fields Qwen3 sets but does not use; one line for what ptdp does not compute."""
    if hf_config.get("use_sliding_window"):
        raise Qwen3ConversionError("--in: config.json has use_sliding_window=true; ptdp attends to the whole "
                                   "causal context")
    odd = sorted({kind for kind in hf_config.get("layer_types") or [] if kind != "full_attention"})
    if odd:
        raise Qwen3ConversionError(f"--in: config.json has layer_types {odd}; ptdp's Qwen3 layers are full_attention")
    if hf_config.get("attention_bias"):
        raise Qwen3ConversionError("--in: config.json has attention_bias=true; ptdp's Qwen3 has no attention biases")
    return {k: v for k, v in hf_config.items() if k not in ("sliding_window", "layer_types", "max_window_layers")}


def _config(hf_config: dict) -> ModelConfig:
    cfg = llama.model_config_from_hf(_check(hf_config))
    head_dim = hf_config.get("head_dim") or cfg.hidden_size // cfg.num_attention_heads
    return dataclasses.replace(cfg, qk_layernorm=True, kv_channels=head_dim)


def _moe(hf_config: dict, num_layers: int) -> MoEConfig:
    step, dense_only = hf_config.get("decoder_sparse_step") or 1, set(hf_config.get("mlp_only_layers") or [])
    pattern = [int(i not in dense_only and (i + 1) % step == 0) for i in range(num_layers)]
    if not any(pattern):
        raise Qwen3ConversionError("--in: config.json's mlp_only_layers/decoder_sparse_step leave no MoE layer; "
                                   "import it as model_type qwen3")
    return MoEConfig(num_experts=hf_config.get("num_experts") or hf_config["num_local_experts"],
                     moe_router_topk=hf_config["num_experts_per_tok"],
                     moe_ffn_hidden_size=hf_config["moe_intermediate_size"],
                     moe_layer_freq="1" if all(pattern) else str(pattern).replace(" ", ""),
                     moe_router_pre_softmax=not hf_config.get("norm_topk_prob", False))


def _norm_recipes(cfg: ModelConfig) -> dict:
    from ptdp.models.hf_recipe import Take

    return {f"layers.{i}.{ours}": Take(f"{P}layers.{i}.{theirs}") for i in range(cfg.num_layers)
            for ours, theirs in _NORMS.items()}


def qwen3_model(hf_config: dict) -> tuple[ModelConfig, MoEConfig]:
    """The model flags of a Qwen3 ``config.json`` (dense)."""
    return _config(hf_config), MoEConfig()


def qwen3_moe_model(hf_config: dict) -> tuple[ModelConfig, MoEConfig]:
    """The model and expert flags of a Qwen3-MoE ``config.json`` (what ``read_qwen3_moe`` reads)."""
    if float(hf_config.get("router_jitter_noise") or 0.0):
        raise Qwen3ConversionError("--in: config.json has router_jitter_noise > 0; ptdp's router adds no noise")
    cfg = _config(hf_config)
    return cfg, _moe(hf_config, cfg.num_layers)


def qwen3_moe_recipes(cfg: ModelConfig, moe: MoEConfig, padded_vocab: int) -> dict:
    """Per ptdp parameter, its recipe over ``Qwen3MoeForCausalLM`` tensors, the experts per expert (what
    ``save_pretrained`` writes: ``mlp.experts.{e}.gate_proj/up_proj/down_proj``) or fused (transformers 5's
    ``mlp.experts.gate_up_proj``/``down_proj``): Mixtral's (``ptdp.models.mixtral.hf``) and the q/k norms."""
    plain = dataclasses.replace(cfg, qk_layernorm=False)
    return {**mixtral.moe_recipes(plain, moe, padded_vocab, "qwen3_moe"), **_norm_recipes(cfg)}


def qwen3_recipes(cfg: ModelConfig, moe: MoEConfig, padded_vocab: int) -> dict:
    """Per ptdp parameter, its recipe over ``Qwen3ForCausalLM`` tensors (``ptdp.models.hf_recipe``): Llama's
    and the q/k norms."""
    return {**llama.hf_recipes(dataclasses.replace(cfg, qk_layernorm=False), padded_vocab), **_norm_recipes(cfg)}


def _norms_to_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return {f"{P}layers.{i}.{theirs}": tensors[f"layers.{i}.{ours}"].detach().float().contiguous()
            for i in range(cfg.num_layers) for ours, theirs in _NORMS.items()}


def _import(recipes_for, hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return llama.import_state(recipes_for, hf, cfg,
                              lambda e: Qwen3ConversionError(f"--in: {e}; is it a Qwen3 model?"))


def read_qwen3(hf_config: dict, hf: dict[str, torch.Tensor]) -> tuple[ModelConfig, MoEConfig, dict]:
    """``ptdp import``: :func:`qwen3_recipes` evaluated whole."""
    cfg, moe = qwen3_model(hf_config)
    return cfg, moe, _import(lambda padded: qwen3_recipes(cfg, moe, padded), hf, cfg)


def read_qwen3_moe(hf_config: dict, hf: dict[str, torch.Tensor]) -> tuple[ModelConfig, MoEConfig, dict]:
    """``ptdp import``: :func:`qwen3_moe_recipes` evaluated whole, over either expert layout."""
    cfg, moe = qwen3_moe_model(hf_config)
    return cfg, moe, _import(lambda padded: qwen3_moe_recipes(cfg, moe, padded), hf, cfg)


def write_qwen3(tensors: dict[str, torch.Tensor], cfg: ModelConfig, moe: MoEConfig) -> dict[str, torch.Tensor]:
    plain = dataclasses.replace(cfg, qk_layernorm=False)
    return {**llama.to_hf_state(tensors, plain), **_norms_to_hf(tensors, cfg)}


def write_qwen3_moe(tensors: dict[str, torch.Tensor], cfg: ModelConfig, moe: MoEConfig) -> dict[str, torch.Tensor]:
    plain = dataclasses.replace(cfg, qk_layernorm=False)
    return {**mixtral.to_hf_state(tensors, plain, moe, "qwen3_moe"), **_norms_to_hf(tensors, cfg)}


def qwen3_config(cfg: ModelConfig, moe: MoEConfig, bos: int | None, eos: int | None) -> dict[str, Any]:
    """``Qwen3Config`` keyword arguments that make HF compute what ptdp computes."""
    kwargs = llama.hf_config_kwargs(dataclasses.replace(cfg, qk_layernorm=False), bos, eos)
    kwargs.pop("mlp_bias")
    return {**kwargs, "use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.num_layers,
            "layer_types": ["full_attention"] * cfg.num_layers, "architectures": ["Qwen3ForCausalLM"]}


def qwen3_moe_config(cfg: ModelConfig, moe: MoEConfig, bos: int | None, eos: int | None) -> dict[str, Any]:
    """``Qwen3MoeConfig`` keyword arguments that make HF compute what ptdp computes."""
    from ptdp.models.moe import moe_layer_pattern

    pattern = moe_layer_pattern(moe.moe_layer_freq, cfg.num_layers)
    kwargs = qwen3_config(cfg, moe, bos, eos)
    for key in ("max_window_layers", "layer_types"):
        kwargs.pop(key)
    return {**kwargs, "num_experts": moe.num_experts, "num_experts_per_tok": moe.moe_router_topk,
            "moe_intermediate_size": moe.moe_ffn_hidden_size or cfg.ffn_size, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, sparse in enumerate(pattern) if not sparse],
            "norm_topk_prob": not moe.moe_router_pre_softmax, "router_jitter_noise": 0.0,
            "architectures": ["Qwen3MoeForCausalLM"]}
