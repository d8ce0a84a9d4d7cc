"""GPT-OSS (OpenAI, 2025): grouped-query attention with biases and a learned attention sink per head, every
other layer a sliding window of 128 tokens, YaRN rotary positions (factor 32 over 4,096), and in every layer a
mixture of experts with biases whose activation is a clamped quick-GeGLU with a +1 on its linear half. The
model is ``GPTModel`` with the flags ``hf._config`` sets; the sinks' sharding rule (split by heads) is in
``ptdp.models.gpt_sharding``."""

from ptdp.models.family import ModelFamily
from ptdp.models.gpt_oss import hf

GPT_OSS = ModelFamily(
    name="GPT-OSS", hf_model_type="gpt_oss", hf_architecture="GptOssForCausalLM", matches=hf.is_gpt_oss,
    read=hf.read_gpt_oss, write=hf.write_gpt_oss, hf_config=hf.gpt_oss_config,
    presets=("gpt-oss-20b", "gpt-oss-120b", "tiny-gpt-oss"), hf_model=hf.gpt_oss_model,
    hf_recipes=hf.gpt_oss_recipes)
