"""Gemma 3 text (Google DeepMind, 2025): grouped-query attention with per-head q/k norms, five sliding-window
layers (w = 512/1024) to one global layer, sandwich norms, zero-centred (1 + w) RMSNorms in fp32, a GeGLU MLP,
embeddings scaled by √h, a softmax scale of query_pre_attn_scalar^-1/2, a rotary base per layer kind (local
10k, global 1M) and tied embeddings. The model is ``GPTModel`` with the flags ``hf.gemma3_flags`` lists; the
sandwich norms' and q/k norms' sharding rules are in ``ptdp.models.gpt_sharding``."""

from ptdp.models.family import ModelFamily
from ptdp.models.gemma3 import hf

GEMMA3 = ModelFamily(
    name="Gemma 3", hf_model_type="gemma3_text", hf_architecture="Gemma3ForCausalLM", matches=hf.is_gemma3,
    read=hf.read_gemma3, write=hf.write_gemma3, hf_config=hf.gemma3_config, export_problem=hf.export_problem,
    presets=("gemma3-1b", "gemma3-27b", "tiny-gemma3"), hf_model=hf.gemma3_model, hf_recipes=hf.gemma3_recipes)
