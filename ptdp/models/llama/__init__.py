"""Llama 2 and 3 (Touvron et al., 2023; Grattafiori et al., 2024): ``GPTModel`` with rotary positions,
RMSNorm, a SwiGLU MLP, grouped-query attention, no biases and an untied output layer."""

from ptdp.config import MoEConfig
from ptdp.models.family import ModelFamily
from ptdp.models.llama import hf


def _read(hf_config: dict, tensors: dict) -> tuple:
    cfg = hf.model_config_from_hf(hf_config)
    return cfg, MoEConfig(), hf.from_hf_state(tensors, cfg)


LLAMA = ModelFamily(
    name="Llama", hf_model_type="llama", hf_architecture="LlamaForCausalLM",
    matches=lambda cfg, moe: not moe.num_experts and hf.is_llama(cfg), read=_read,
    write=lambda tensors, cfg, moe: hf.to_hf_state(tensors, cfg),
    hf_config=lambda cfg, moe, bos, eos: hf.hf_config_kwargs(cfg, bos, eos),
    presets=("llama2-7b", "llama3-8b", "llama3-70b", "tiny-llama"),
    hf_model=lambda hf_config: (hf.model_config_from_hf(hf_config), MoEConfig()),
    hf_recipes=lambda cfg, moe, padded: hf.hf_recipes(cfg, padded))
