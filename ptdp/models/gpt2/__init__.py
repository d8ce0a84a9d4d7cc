"""GPT-2 (Radford et al., 2019), the architecture ``GPTModel``'s defaults describe: learned positions,
LayerNorm, a GeLU MLP, biases, the output layer tied to the embedding."""

from ptdp.config import MoEConfig
from ptdp.models.family import ModelFamily
from ptdp.models.gpt2 import hf


def _read(hf_config: dict, tensors: dict) -> tuple:
    cfg = hf.model_config_from_hf(hf_config)
    return cfg, MoEConfig(), hf.from_hf_state(tensors, cfg)


GPT2 = ModelFamily(
    name="GPT-2", hf_model_type="gpt2", hf_architecture="GPT2LMHeadModel",
    matches=lambda cfg, moe: not moe.num_experts and hf.is_gpt2(cfg), read=_read,
    write=lambda tensors, cfg, moe: hf.to_hf_state(tensors, cfg),
    hf_config=lambda cfg, moe, bos, eos: hf.hf_config_dict(cfg, eos), presets=("gpt3-175b", "tiny-gpt"),
    hf_model=lambda hf_config: (hf.model_config_from_hf(hf_config), MoEConfig()),
    hf_recipes=lambda cfg, moe, padded: hf.gpt2_recipes(cfg, padded))
