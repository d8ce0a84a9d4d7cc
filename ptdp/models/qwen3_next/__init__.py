"""Qwen3-Next (Qwen team, 2025): three Gated DeltaNet layers (``ptdp.models.gated_deltanet``) to one gated
full-attention layer (Qwen3's attention with a sigmoid output gate and partial rotary), zero-centred RMSNorms,
and a sparse mixture of experts with a sigmoid-gated shared expert. The model is ``GPTModel`` with the flags
``hf`` lists; the Gated DeltaNet's sharding rules are in ``ptdp.models.gpt_sharding``."""

from ptdp.models.family import ModelFamily
from ptdp.models.qwen3_next import hf

QWEN3_NEXT = ModelFamily(
    name="Qwen3-Next", hf_model_type="qwen3_next", hf_architecture="Qwen3NextForCausalLM", matches=hf.is_qwen3_next,
    read=hf.read_qwen3_next, write=hf.write_qwen3_next, hf_config=hf.qwen3_next_config,
    export_problem=hf.export_problem, presets=("qwen3-next-80b-a3b", "tiny-qwen3-next"),
    hf_model=hf.qwen3_next_model, hf_recipes=hf.qwen3_next_recipes)
