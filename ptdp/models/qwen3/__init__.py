"""Qwen3 and Qwen3-MoE (Qwen team, 2025): Llama with a per-head q/k RMSNorm and a head dimension of its own;
the MoE variant with Mixtral-style experts and no shared expert. The model is ``GPTModel`` with
``--qk-layernorm``; its sharding rules mark the q/k norms partial over the tensor-parallel heads."""

from ptdp.models.family import ModelFamily
from ptdp.models.qwen3 import hf

QWEN3 = ModelFamily(
    name="Qwen3", hf_model_type="qwen3", hf_architecture="Qwen3ForCausalLM", matches=hf.is_qwen3,
    read=hf.read_qwen3, write=hf.write_qwen3, hf_config=hf.qwen3_config,
    presets=("qwen3-0.6b", "qwen3-8b", "qwen3-32b", "tiny-qwen3"),
    hf_model=hf.qwen3_model, hf_recipes=hf.qwen3_recipes)

QWEN3_MOE = ModelFamily(
    name="Qwen3-MoE", hf_model_type="qwen3_moe", hf_architecture="Qwen3MoeForCausalLM", matches=hf.is_qwen3_moe,
    read=hf.read_qwen3_moe, write=hf.write_qwen3_moe, hf_config=hf.qwen3_moe_config,
    presets=("qwen3-30b-a3b", "qwen3-235b-a22b", "tiny-qwen3-moe"),
    hf_model=hf.qwen3_moe_model, hf_recipes=hf.qwen3_moe_recipes)
