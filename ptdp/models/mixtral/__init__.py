"""Mixtral (Jiang et al., 2024) and Qwen2-MoE / Qwen1.5-MoE: the Llama architecture with a mixture of
experts in place of the MLP (``ptdp.models.moe``); Qwen2-MoE adds a gated shared expert and a QKV bias."""

from functools import partial

from ptdp.models.family import ModelFamily
from ptdp.models.mixtral import hf


def _read(kind: str, hf_config: dict, tensors: dict) -> tuple:
    cfg, moe, _ = hf.model_config_from_hf(hf_config)
    return cfg, moe, hf.from_hf_state(tensors, cfg, moe, kind)


def _family(name: str, kind: str, architecture: str, presets: tuple[str, ...]) -> ModelFamily:
    return ModelFamily(
        name=name, hf_model_type=kind, hf_architecture=architecture,
        matches=lambda cfg, moe: not cfg.qk_layernorm and hf.hf_kind(cfg, moe) == kind, read=partial(_read, kind),
        write=lambda tensors, cfg, moe: hf.to_hf_state(tensors, cfg, moe, kind),
        hf_config=lambda cfg, moe, bos, eos: hf.hf_config_kwargs(cfg, moe, kind, bos, eos), presets=presets,
        hf_model=lambda hf_config: hf.model_config_from_hf(hf_config)[:2],
        hf_recipes=lambda cfg, moe, padded: hf.moe_recipes(cfg, moe, padded, kind))


MIXTRAL = _family("Mixtral", "mixtral", "MixtralForCausalLM", ("mixtral-8x7b", "tiny-mixtral"))
QWEN2_MOE = _family("Qwen2-MoE", "qwen2_moe", "Qwen2MoeForCausalLM", ("qwen1.5-moe-a2.7b",))
