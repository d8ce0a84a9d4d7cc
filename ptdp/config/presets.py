"""``--model NAME``: named model shapes for ``ptdp train`` and ``ptdp plan``.

A preset is nothing but values of ``ModelConfig`` fields, i.e. of Megatron-LM flags, so it is applied
under the TOML file and the command line: any flag given explicitly overrides it. The published shapes
follow the models' own configurations (GPT-3 paper Table 2.1; Meta's Llama 2/3 ``params.json`` and the
Hugging Face ``config.json`` of the same models). The ``tiny-*`` presets are the smallest models that
every test layout can split (8 layers for p·v = 8, two KV groups for t = 2).
"""

from __future__ import annotations

from typing import Any

# What every Llama shares: rotary positions, RMSNorm, SwiGLU, no biases, untied output, no dropout.
_LLAMA: dict[str, Any] = {
    "position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
    "disable_bias_linear": True, "untie_embeddings_and_output_weights": True,
    "hidden_dropout": 0.0, "attention_dropout": 0.0,
}

# DeepSeek-V3's multi-latent attention (Megatron-Core's flags) with YaRN (factor 40 from a 4K context).
_MLA: dict[str, Any] = {
    "multi_latent_attention": True, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_head_dim": 128,
    "qk_pos_emb_head_dim": 64, "v_head_dim": 128, "rope_type": "yarn", "rotary_scaling_factor": 40.0,
    "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
    "beta_slow": 1.0,
}

# What every Qwen3 shares: Llama with a per-head q/k norm, grouped queries and a 128-wide head.
_QWEN3: dict[str, Any] = {
    **_LLAMA, "qk_layernorm": True, "group_query_attention": True, "kv_channels": 128, "seq_length": 4096,
    "max_position_embeddings": 40960, "vocab_size": 151936, "norm_epsilon": 1e-6, "rotary_base": 1000000.0,
}

# What every Gemma 3 shares (HF config.json of google/gemma-3-*-pt, text config): GQA with q/k norms, five
# sliding-window layers to one global, sandwich (1 + w) RMSNorms, GeGLU, √h embeddings, tied output, rotary
# bases 1M (global) and 10k (local). --seq-length is a training context of ours (the models' is 32K).
_GEMMA3: dict[str, Any] = {
    **_LLAMA, "swiglu": False, "geglu": True, "qk_layernorm": True, "sandwich_norm": True,
    "apply_layernorm_1p": True, "scale_embedding": True, "untie_embeddings_and_output_weights": False,
    "group_query_attention": True, "window_attn_skip_freq": "6", "rotary_base": 1000000.0,
    "local_rotary_base": 10000.0, "norm_epsilon": 1e-6, "seq_length": 4096,
}

# What every GPT-OSS shares (HF config.json of openai/gpt-oss-*): GQA of 64 heads in 8 groups of width 64 with
# biases and a learned sink per head, every other layer (the first) a window of 128, YaRN (factor 32 over
# 4,096, the ramp unrounded), untied output, every layer a mixture of experts (_GPT_OSS_MOE) whose clamped
# quick-GeGLU has a +1 on its linear half.
_GPT_OSS: dict[str, Any] = {
    **_LLAMA, "swiglu": False, "quick_geglu": True, "glu_linear_offset": 1.0, "activation_func_clamp_value": 7.0,
    "disable_bias_linear": False, "softmax_type": "learnable", "group_query_attention": True,
    "num_attention_heads": 64, "num_query_groups": 8, "kv_channels": 64, "hidden_size": 2880,
    "ffn_hidden_size": 2880, "window_size": 128, "window_attn_skip_freq": "2", "rotary_base": 150000.0,
    "rope_type": "yarn", "rotary_scaling_factor": 32.0, "original_max_position_embeddings": 4096,
    "beta_fast": 32.0, "beta_slow": 1.0, "yarn_correction_range_round_to_int": False, "norm_epsilon": 1e-5,
    "seq_length": 4096, "max_position_embeddings": 131072, "vocab_size": 201088,
}
_GPT_OSS_MOE: dict[str, Any] = {"moe_router_topk": 4, "moe_ffn_hidden_size": 2880, "moe_linear_bias": True}
# What every Qwen3-Next shares (HF config.json of Qwen/Qwen3-Next-80B-A3B-*): three Gated DeltaNet layers to
# one full-attention layer with an output gate, partial rotary (a quarter of each head), zero-centred norms.
_QWEN3_NEXT: dict[str, Any] = {
    **_LLAMA, "qk_layernorm": True, "apply_layernorm_1p": True, "attention_output_gate": True,
    "group_query_attention": True, "rotary_percent": 0.25, "norm_epsilon": 1e-6, "seq_length": 4096,
    "experimental_attention_variant": "gated_delta_net", "linear_attention_freq": "4", "linear_conv_kernel_dim": 4,
}

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "gpt3-175b": {"num_layers": 96, "hidden_size": 12288, "num_attention_heads": 96, "seq_length": 2048,
                  "vocab_size": 51200},
    "llama2-7b": {**_LLAMA, "num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                  "ffn_hidden_size": 11008, "seq_length": 4096, "vocab_size": 32000, "norm_epsilon": 1e-5,
                  "rotary_base": 10000.0},
    "llama3-8b": {**_LLAMA, "num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                  "group_query_attention": True, "num_query_groups": 8, "ffn_hidden_size": 14336,
                  "seq_length": 8192, "vocab_size": 128256, "norm_epsilon": 1e-5, "rotary_base": 500000.0},
    "llama3-70b": {**_LLAMA, "num_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
                   "group_query_attention": True, "num_query_groups": 8, "ffn_hidden_size": 28672,
                   "seq_length": 8192, "vocab_size": 128256, "norm_epsilon": 1e-5, "rotary_base": 500000.0},
    # mixtures of experts: the attention and shape here, the experts in MOE_PRESETS
    "mixtral-8x7b": {**_LLAMA, "num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                     "group_query_attention": True, "num_query_groups": 8, "ffn_hidden_size": 14336,
                     "seq_length": 32768, "vocab_size": 32000, "norm_epsilon": 1e-5, "rotary_base": 1000000.0},
    "qwen1.5-moe-a2.7b": {**_LLAMA, "num_layers": 24, "hidden_size": 2048, "num_attention_heads": 16,
                          "ffn_hidden_size": 5632, "seq_length": 8192, "vocab_size": 151936, "norm_epsilon": 1e-6,
                          "rotary_base": 1000000.0, "add_qkv_bias": True},
    # DeepSeek-V3 (HF config.json of deepseek-ai/DeepSeek-V3; the report's 4K pre-training context, YaRN's
    # parameters for the 128K extension): MLA, 3 dense layers then 58 MoE ones, one MTP module
    "deepseek-v3": {**_LLAMA, "num_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
                    "ffn_hidden_size": 18432, "seq_length": 4096, "vocab_size": 129280, "norm_epsilon": 1e-6,
                    "rotary_base": 10000.0, **_MLA, "mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.1},
    # Qwen3 (HF config.json of Qwen/Qwen3-*): q/k RMSNorm per head, head_dim 128 apart from h/a, 40,960 positions
    "qwen3-0.6b": {**_QWEN3, "num_layers": 28, "hidden_size": 1024, "num_attention_heads": 16,
                   "num_query_groups": 8, "ffn_hidden_size": 3072, "untie_embeddings_and_output_weights": False},
    "qwen3-8b": {**_QWEN3, "num_layers": 36, "hidden_size": 4096, "num_attention_heads": 32, "num_query_groups": 8,
                 "ffn_hidden_size": 12288},
    "qwen3-32b": {**_QWEN3, "num_layers": 64, "hidden_size": 5120, "num_attention_heads": 64, "num_query_groups": 8,
                  "ffn_hidden_size": 25600},
    "qwen3-30b-a3b": {**_QWEN3, "num_layers": 48, "hidden_size": 2048, "num_attention_heads": 32,
                      "num_query_groups": 4, "ffn_hidden_size": 6144},
    "qwen3-235b-a22b": {**_QWEN3, "num_layers": 94, "hidden_size": 4096, "num_attention_heads": 64,
                        "num_query_groups": 4, "ffn_hidden_size": 12288},
    # Gemma 3 1B (google/gemma-3-1b-pt) and 27B (gemma-3-27b-pt's text config, without its linear rope
    # scaling of factor 8 for the 128K context, which ptdp does not compute)
    "gemma3-1b": {**_GEMMA3, "num_layers": 26, "hidden_size": 1152, "num_attention_heads": 4, "num_query_groups": 1,
                  "kv_channels": 256, "ffn_hidden_size": 6912, "window_size": 512, "softmax_scale": 256 ** -0.5,
                  "max_position_embeddings": 32768, "vocab_size": 262144},
    "gemma3-27b": {**_GEMMA3, "num_layers": 62, "hidden_size": 5376, "num_attention_heads": 32,
                   "num_query_groups": 16, "kv_channels": 128, "ffn_hidden_size": 21504, "window_size": 1024,
                   "softmax_scale": 168 ** -0.5, "max_position_embeddings": 131072, "vocab_size": 262208},
    # GPT-OSS 20B and 120B (openai/gpt-oss-20b, -120b): 24 and 36 layers, 32 and 128 experts
    "gpt-oss-20b": {**_GPT_OSS, "num_layers": 24},
    "gpt-oss-120b": {**_GPT_OSS, "num_layers": 36},
    # test-sized models (the tokenizer decides the vocabulary)
    "tiny-gpt": {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
                 "hidden_dropout": 0.0, "attention_dropout": 0.0},
    "tiny-llama": {**_LLAMA, "num_layers": 8, "hidden_size": 32, "num_attention_heads": 4,
                   "group_query_attention": True, "num_query_groups": 2, "ffn_hidden_size": 64,
                   "seq_length": 16, "norm_epsilon": 1e-6},
}

# ``MoEConfig`` values of the mixture-of-experts presets (HF config.json of Mixtral-8x7B-v0.1 and
# Qwen1.5-MoE-A2.7B), applied with MODEL_PRESETS' entry of the same name.
MOE_PRESETS: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": {"num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 14336},
    "qwen1.5-moe-a2.7b": {"num_experts": 60, "moe_router_topk": 4, "moe_ffn_hidden_size": 1408,
                          "moe_shared_expert_intermediate_size": 5632, "moe_shared_expert_gate": True,
                          "moe_router_pre_softmax": True},
    "tiny-mixtral": {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32},
    # Qwen3-MoE: 128 experts, top-8 renormalised, no shared expert, every layer MoE
    "qwen3-30b-a3b": {"num_experts": 128, "moe_router_topk": 8, "moe_ffn_hidden_size": 768},
    "qwen3-235b-a22b": {"num_experts": 128, "moe_router_topk": 8, "moe_ffn_hidden_size": 1536},
    "tiny-qwen3-moe": {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32},
    # DeepSeek-V3's router (HF config.json; Megatron-Core's recipe: sequence-wise balance loss alpha = 1e-4)
    "deepseek-v3": {"num_experts": 256, "moe_router_topk": 8, "moe_ffn_hidden_size": 2048,
                    "moe_shared_expert_intermediate_size": 2048, "moe_layer_freq": "([0]*3+[1]*58)",
                    "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                    "moe_router_num_groups": 8, "moe_router_group_topk": 4, "moe_router_topk_scaling_factor": 2.5,
                    "moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 1e-4},
    "tiny-deepseek": {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 16,
                      "moe_shared_expert_intermediate_size": 16, "moe_layer_freq": "([0]*1+[1]*3)",
                      "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                      "moe_router_num_groups": 2, "moe_router_group_topk": 1, "moe_router_topk_scaling_factor": 2.5},
}
MODEL_PRESETS["qwen3-next-80b-a3b"] = {
    **_QWEN3_NEXT, "num_layers": 48, "hidden_size": 2048, "num_attention_heads": 16, "num_query_groups": 2,
    "kv_channels": 256, "ffn_hidden_size": 5120, "max_position_embeddings": 262144, "vocab_size": 151936,
    "rotary_base": 10000000.0, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32}
MOE_PRESETS["qwen3-next-80b-a3b"] = {"num_experts": 512, "moe_router_topk": 10, "moe_ffn_hidden_size": 512,
                                     "moe_shared_expert_intermediate_size": 512, "moe_shared_expert_gate": True}
# tiny-qwen3-next: 8 layers (two full-attention ones), key heads and query groups that t = 2 splits
MODEL_PRESETS["tiny-qwen3-next"] = {
    **_QWEN3_NEXT, "num_layers": 8, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
    "kv_channels": 16, "ffn_hidden_size": 64, "seq_length": 16, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4}
MOE_PRESETS["tiny-qwen3-next"] = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32,
                                  "moe_shared_expert_intermediate_size": 32, "moe_shared_expert_gate": True}
MODEL_PRESETS["tiny-mixtral"] = dict(MODEL_PRESETS["tiny-llama"])
MODEL_PRESETS["tiny-qwen3"] = {**MODEL_PRESETS["tiny-llama"], "qk_layernorm": True, "kv_channels": 16}
MODEL_PRESETS["tiny-qwen3-moe"] = dict(MODEL_PRESETS["tiny-qwen3"])
# tiny-gemma3: windows of 4 tokens at --seq-length 16, every third layer global
MODEL_PRESETS["tiny-gemma3"] = {
    **_GEMMA3, "num_layers": 8, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
    "kv_channels": 16, "ffn_hidden_size": 64, "seq_length": 16, "window_size": 4, "window_attn_skip_freq": "3",
    "softmax_scale": 16 ** -0.5}
# tiny-deepseek: the DeepSeek-V3 architecture at test size (MLA with a query compression, one dense layer
# then MoE ones, one MTP module); a large bias update rate makes the bias move the routing within a test
MODEL_PRESETS["tiny-deepseek"] = {
    **_LLAMA, "num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64,
    "seq_length": 16, "norm_epsilon": 1e-6, "multi_latent_attention": True, "q_lora_rank": 16,
    "kv_lora_rank": 16, "qk_head_dim": 8, "qk_pos_emb_head_dim": 4, "v_head_dim": 8, "mtp_num_layers": 1}
MOE_PRESETS["tiny-deepseek"]["moe_router_bias_update_rate"] = 0.05
# tiny-gpt-oss: the GPT-OSS architecture at test size (windows of 4 tokens at --seq-length 16 on every other
# layer, YaRN over an original context of 8)
MODEL_PRESETS["tiny-gpt-oss"] = {
    **_GPT_OSS, "num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
    "kv_channels": 16, "ffn_hidden_size": 32, "seq_length": 16, "window_size": 4, "rotary_scaling_factor": 4.0,
    "original_max_position_embeddings": 8, "max_position_embeddings": 64, "vocab_size": None}
MOE_PRESETS["gpt-oss-20b"] = {**_GPT_OSS_MOE, "num_experts": 32}
MOE_PRESETS["gpt-oss-120b"] = {**_GPT_OSS_MOE, "num_experts": 128}
MOE_PRESETS["tiny-gpt-oss"] = {**_GPT_OSS_MOE, "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32}

# Global batch sizes the planner assumes when --global-batch-size is not given (the papers' runs).
PLAN_GLOBAL_BATCH = {"gpt3-175b": 1536, "llama2-7b": 1024, "llama3-8b": 512, "llama3-70b": 512,
                     "deepseek-v3": 15360}  # the report's batch of 15,360 sequences (after its ramp-up)


def model_family(cfg: Any) -> str:
    """A short name for the architecture a ``ModelConfig`` describes (for the start-up summary)."""
    if getattr(cfg, "experimental_attention_variant", None) == "gated_delta_net":
        return (f"Qwen3-Next (Gated DeltaNet, --linear-attention-freq {cfg.linear_attention_freq}, "
                f"GQA {cfg.query_groups} groups)")
    if getattr(cfg, "geglu", False) and getattr(cfg, "sandwich_norm", False):
        window = f"window {cfg.window_size}" if getattr(cfg, "window_size", None) else "no window"
        return f"Gemma 3 (GQA {cfg.query_groups} groups, {window}, {'untied' if cfg.untie_embeddings_and_output_weights else 'tied'} output)"
    if getattr(cfg, "quick_geglu", False) and getattr(cfg, "softmax_type", "vanilla") == "learnable":
        window = f"window {cfg.window_size}" if getattr(cfg, "window_size", None) else "no window"
        return f"GPT-OSS (GQA {cfg.query_groups} groups, sinks, {window})"
    llama = (cfg.position_embedding_type == "rope" and cfg.normalization == "RMSNorm" and cfg.swiglu)
    if llama:
        attention = f"GQA {cfg.query_groups} groups" if cfg.query_groups < cfg.num_attention_heads else "MHA"
        attention = "MLA" if getattr(cfg, "multi_latent_attention", False) else attention
        attention += f", {cfg.mtp_num_layers} MTP" if getattr(cfg, "mtp_num_layers", None) else ""
        attention += ", q/k norm" if getattr(cfg, "qk_layernorm", False) else ""
        return f"Llama ({attention}, {'untied' if cfg.untie_embeddings_and_output_weights else 'tied'} output)"
    if (cfg.position_embedding_type, cfg.normalization, cfg.swiglu) == ("learned_absolute", "LayerNorm", False):
        return "GPT-2"
    return (f"GPT ({cfg.position_embedding_type} positions, {cfg.normalization}, "
            f"{'SwiGLU' if cfg.swiglu else 'GeLU'} MLP)")
