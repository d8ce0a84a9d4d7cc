"""DeepSeek-V3 (DeepSeek-AI, 2024): multi-latent attention (``ptdp.models.mla``), a sigmoid-routed mixture
of experts with a shared expert and group-limited routing, multi-token prediction (``ptdp.models.mtp``)."""

from ptdp.models.deepseek_v3 import hf
from ptdp.models.family import ModelFamily

DEEPSEEK_V3 = ModelFamily(
    name="DeepSeek-V3", hf_model_type="deepseek_v3", hf_architecture="DeepseekV3ForCausalLM",
    matches=lambda cfg, moe: cfg.multi_latent_attention, read=hf.import_model,
    write=hf.to_hf_state, hf_config=hf.hf_config_kwargs, export_problem=hf.export_problem,
    presets=("deepseek-v3", "tiny-deepseek"), hf_model=hf.model_config_from_hf, hf_recipes=hf.deepseek_recipes,
    hf_refine=hf.with_mtp)
