"""Hugging Face ``DeepseekV3ForCausalLM`` export and import (``ptdp export/import --format hf``, through the
family registry for ``model_type`` "deepseek_v3" and for multi-latent attention models).

DeepSeek-V3 is ptdp's Llama options plus multi-latent attention (``ptdp.models.mla``), the sigmoid router
with an expert bias, groups and a scaling factor (``ptdp.models.moe``), the first k layers dense, a shared
expert, and multi-token prediction (``ptdp.models.mtp``). Conversion is renaming, with two layout changes:

- attention: ``q_a_proj``/``q_a_layernorm``/``q_b_proj`` (or ``q_proj``), ``kv_a_proj_with_mqa``,
  ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj`` are ptdp's ``q_down_proj``/``q_layernorm``/``q_up_proj``
  (``q_proj``), ``kv_down_proj``, ``kv_layernorm``, ``kv_up_proj``, ``proj``, same shapes and row orders.
- experts: per expert on disk (``mlp.experts.{i}.gate_proj/up_proj/down_proj``) or fused (transformers 5's
  ``gate_up_proj``/``down_proj``, in memory or saved so), stacked ``experts.fc1_weight [E, 2, f, h]`` as for Qwen2-MoE
  (``ptdp.models.mixtral.hf``); the router ``mlp.gate.weight`` and its ``e_score_correction_bias`` are ``mlp.router.weight``
  and ``mlp.router.expert_bias``; ``mlp.shared_experts`` is ``mlp.shared_expert``.
- MTP module k lives at layer index ``num_hidden_layers + k`` of the checkpoint (``enorm``, ``hnorm``,
  ``eh_proj``, ``shared_head.norm``, and a copy of the embedding and output layer that ptdp shares);
  transformers' forward ignores it.

HF's router and ptdp's (Megatron-Core's) agree when the k chosen scores are normalised for k > 1 and not for
k = 1, and, with groups, when a group's score is the sum of its top k/g = 2 scores (HF's is always its top
2); YaRN agrees when the table scale is HF's (``mscale`` and ``mscale_all_dim`` both set, or ``mscale`` 1).
HF's latent norms use eps 1e-6 whatever ``rms_norm_eps``, so a model with another eps is refused. Whatever
else ptdp does not compute is refused with one line instead of converting into a different model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ptdp.config import ConfigError, ModelConfig, MoEConfig
from ptdp.config.validate_moe import rope_type
from ptdp.models.llama import hf as hf_llama
from ptdp.models.mixtral import hf as hf_moe

# ``ptdp train`` flags an imported DeepSeek-V3 needs beyond the Llama family's (``convert.train_flags``)
MODEL_FLAGS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
               "v_head_dim", "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim",
               "original_max_position_embeddings", "beta_fast", "beta_slow", "mtp_num_layers")

if TYPE_CHECKING:
    from collections.abc import Collection

    import torch

P = hf_llama.HF_PREFIX
LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default, which HF's q_a_layernorm and kv_a_layernorm keep

_ATTENTION = {  # ptdp suffix inside <layer>.attention -> HF suffix inside <layer>.self_attn
    "q_proj.weight": "q_proj.weight", "q_down_proj.weight": "q_a_proj.weight",
    "q_layernorm.weight": "q_a_layernorm.weight", "q_up_proj.weight": "q_b_proj.weight",
    "kv_down_proj.weight": "kv_a_proj_with_mqa.weight", "kv_layernorm.weight": "kv_a_layernorm.weight",
    "kv_up_proj.weight": "kv_b_proj.weight", "proj.weight": "o_proj.weight",
}
_MTP = {"embedding_layernorm.weight": "enorm.weight", "hidden_layernorm.weight": "hnorm.weight",
        "eh_proj.weight": "eh_proj.weight", "final_layernorm.weight": "shared_head.norm.weight"}


class DeepSeekConversionError(ConfigError):
    """Something in the model or its files that ptdp's DeepSeek-V3 cannot represent; one line."""


def _pattern(cfg: ModelConfig, moe: MoEConfig) -> list[bool]:
    from ptdp.models.moe import moe_layer_pattern

    return moe_layer_pattern(moe.moe_layer_freq, cfg.num_layers) if moe.num_experts else [False] * cfg.num_layers


def export_problem(cfg: ModelConfig, moe: MoEConfig) -> str | None:
    """Why HF's ``DeepseekV3ForCausalLM`` would not compute what this multi-latent-attention model does."""
    llama_like = (cfg.normalization == "RMSNorm" and cfg.swiglu and cfg.disable_bias_linear
                  and cfg.position_embedding_type == "rope" and cfg.norm_epsilon == LATENT_NORM_EPS)
    if not llama_like:
        return "DeepSeek-V3 export needs RMSNorm (eps 1e-6), SwiGLU, rotary positions and no linear biases"
    pattern = _pattern(cfg, moe)
    k = pattern.index(True) if any(pattern) else cfg.num_layers
    if pattern != [False] * k + [True] * (cfg.num_layers - k):
        return "DeepSeek-V3 export needs the MoE layers to be all the layers after the first k (--moe-layer-freq)"
    if rope_type(cfg) == "yarn" and cfg.rotary_scaling_factor > 1 and not (
            (cfg.mscale and cfg.mscale_all_dim) or cfg.mscale == 1.0):
        return "DeepSeek-V3 export of YaRN needs --mscale and --mscale-all-dim both non-zero, or --mscale 1"
    if not moe.num_experts:
        return None if not cfg.mtp_num_layers else "DeepSeek-V3 export of MTP modules needs experts"
    groups, group_topk = moe.moe_router_num_groups, moe.moe_router_group_topk
    if (moe.moe_router_score_function != "sigmoid" or not moe.moe_shared_expert_intermediate_size
            or moe.moe_shared_expert_gate or moe.moe_shared_expert_intermediate_size % _expert_ffn(cfg, moe)):
        return ("DeepSeek-V3 export needs the sigmoid router and an ungated shared expert of a multiple of the "
                "experts' hidden size")
    if groups and (moe.moe_router_topk // group_topk != 2) or moe.num_experts // (groups or 1) < 2:
        return "DeepSeek-V3 export needs groups of 2 experts or more, ranked by their top 2 (topk / group-topk = 2)"
    return None


def _expert_ffn(cfg: ModelConfig, moe: MoEConfig) -> int:
    return moe.moe_ffn_hidden_size or cfg.ffn_size


def _layer_names(cfg: ModelConfig, ours: str, theirs: str, sparse: bool) -> dict[str, str]:
    """ptdp name -> HF name of one transformer layer's tensors that convert unchanged (no experts, no fc1)."""
    names = {ours + "input_layernorm.weight": theirs + "input_layernorm.weight",
             ours + "post_attention_layernorm.weight": theirs + "post_attention_layernorm.weight"}
    skip = ("q_proj.weight",) if cfg.q_lora_rank is not None else ("q_down_proj", "q_layernorm", "q_up_proj")
    for suffix, hf_suffix in _ATTENTION.items():
        if not suffix.startswith(skip):
            names[f"{ours}attention.{suffix}"] = f"{theirs}self_attn.{hf_suffix}"
    if sparse:
        names.update({ours + "mlp.router.weight": theirs + "mlp.gate.weight",
                      ours + "mlp.router.expert_bias": theirs + "mlp.gate.e_score_correction_bias",
                      ours + "mlp.shared_expert.fc2.weight": theirs + "mlp.shared_experts.down_proj.weight"})
    else:
        names[ours + "mlp.fc2.weight"] = theirs + "mlp.down_proj.weight"
    return names


def _layers(cfg: ModelConfig, moe: MoEConfig) -> list[tuple[str, str, bool]]:
    """(ptdp prefix, HF prefix, MoE?) of every transformer layer, the MTP modules' last."""
    pattern = _pattern(cfg, moe)
    out = [(f"layers.{i}.", f"{P}layers.{i}.", sparse) for i, sparse in enumerate(pattern)]
    return out + [(f"mtp.layers.{k}.transformer_layer.", f"{P}layers.{cfg.num_layers + k}.", pattern[-1])
                  for k in range(cfg.mtp_num_layers or 0)]


def deepseek_recipes(cfg: ModelConfig, moe: MoEConfig, padded_vocab: int) -> dict:
    """Per ptdp parameter, its recipe over ``DeepseekV3ForCausalLM`` tensors, the experts in either layout
    (``ptdp.models.hf_recipe``): the embedding and untied head padded with zero rows to ``padded_vocab``, the
    MLA tensors and norms taken as they are, each fc1 stacking (gate, up), the experts stacked as Mixtral's,
    the MTP modules' own tensors. The MTP modules' copies of the embedding and head (DeepSeek's files hold
    them again in each module's layer) are ``Copies``: never read, written on export. A router without an
    expert bias has no recipe for it (HF starts a missing ``e_score_correction_bias`` at zero)."""
    from ptdp.models.hf_recipe import Cat, Copies, Stack, Take, Zeros

    vocab, h = cfg.vocab_size, cfg.hidden_size
    pad = (Zeros((padded_vocab - vocab, h)),) if padded_vocab > vocab else ()
    mtp = [f"{P}layers.{cfg.num_layers + k}." for k in range(cfg.mtp_num_layers or 0)]
    embeds, heads = tuple(m + "embed_tokens.weight" for m in mtp), tuple(m + "shared_head.head.weight" for m in mtp)
    untied = cfg.untie_embeddings_and_output_weights
    out: dict = {hf_llama.EMBEDDING: Cat((Copies(Take(P + "embed_tokens.weight"), embeds + (() if untied else heads)),
                                          *pad)),
                 "final_layernorm.weight": Take(P + "norm.weight")}
    if untied:
        out[hf_llama.LM_HEAD] = Cat((Copies(Take(hf_llama.LM_HEAD), heads), *pad))
    for ours, theirs, sparse in _layers(cfg, moe):
        names = _layer_names(cfg, ours, theirs, sparse)
        if not moe.moe_router_enable_expert_bias:
            names.pop(ours + "mlp.router.expert_bias", None)
        out.update({name: Take(hf_name) for name, hf_name in names.items()})
        mlp = theirs + ("mlp.shared_experts." if sparse else "mlp.")
        fc1 = ours + ("mlp.shared_expert.fc1.weight" if sparse else "mlp.fc1.weight")
        out[fc1] = Stack((Take(mlp + "gate_proj.weight"), Take(mlp + "up_proj.weight")))
        if sparse:
            out.update(hf_moe.expert_recipes(ours, theirs, moe.num_experts, "deepseek_v3"))
    for k in range(cfg.mtp_num_layers or 0):
        out.update({f"mtp.layers.{k}.{suffix}": Take(f"{P}layers.{cfg.num_layers + k}.{hf_suffix}")
                    for suffix, hf_suffix in _MTP.items()})
    return out


def from_hf_state(hf: dict[str, torch.Tensor], cfg: ModelConfig, moe: MoEConfig) -> dict[str, torch.Tensor]:
    """HF DeepSeek-V3 tensors (either expert layout) -> ptdp full tensors: :func:`deepseek_recipes`
    evaluated whole."""
    return hf_llama.import_state(
        lambda padded: deepseek_recipes(cfg, moe, padded), hf, cfg,
        lambda e: DeepSeekConversionError(f"--in: {e}; is it a DeepSeek-V3 model?"))


def to_hf_state(tensors: dict[str, torch.Tensor], cfg: ModelConfig, moe: MoEConfig) -> dict[str, torch.Tensor]:
    """ptdp full tensors -> HF DeepSeek-V3 tensors, experts per expert (the files transformers 4 and 5 load);
    a router without an expert bias gets a zero ``e_score_correction_bias``."""
    import torch

    vocab = cfg.vocab_size
    embedding = tensors[hf_llama.EMBEDDING][:vocab]
    head = tensors[hf_llama.LM_HEAD][:vocab] if cfg.untie_embeddings_and_output_weights else embedding
    out = {P + "embed_tokens.weight": embedding, P + "norm.weight": tensors["final_layernorm.weight"]}
    if cfg.untie_embeddings_and_output_weights:
        out[hf_llama.LM_HEAD] = head
    for ours, theirs, sparse in _layers(cfg, moe):
        for name, hf_name in _layer_names(cfg, ours, theirs, sparse).items():
            no_bias = name.endswith("expert_bias") and name not in tensors  # a router without an expert bias
            out[hf_name] = torch.zeros(moe.num_experts) if no_bias else tensors[name]
        mlp = theirs + ("mlp.shared_experts." if sparse else "mlp.")
        gate, up = tensors[ours + ("mlp.shared_expert.fc1.weight" if sparse else "mlp.fc1.weight")]
        out.update({mlp + "gate_proj.weight": gate, mlp + "up_proj.weight": up})
        if sparse:
            fc1, fc2 = tensors[ours + "mlp.experts.fc1_weight"], tensors[ours + "mlp.experts.fc2_weight"]
            for e in range(fc1.shape[0]):
                expert = f"{theirs}mlp.experts.{e}."
                out.update({expert + "gate_proj.weight": fc1[e, 0], expert + "up_proj.weight": fc1[e, 1],
                            expert + "down_proj.weight": fc2[e]})
    for k in range(cfg.mtp_num_layers or 0):  # DeepSeek's files hold the shared embedding and head again
        theirs = f"{P}layers.{cfg.num_layers + k}."
        out.update({theirs + hf_suffix: tensors[f"mtp.layers.{k}.{suffix}"] for suffix, hf_suffix in _MTP.items()})
        out.update({theirs + "embed_tokens.weight": embedding.clone(), theirs + "shared_head.head.weight": head.clone()})
    return {k: v.detach().to(torch.float32).contiguous() for k, v in out.items()}


def _yarn(hf_config: dict) -> dict[str, Any]:
    """ptdp's rope flags for HF's ``rope_parameters`` (default or yarn)."""
    theta, scaling = hf_llama._rope(hf_config)
    if scaling is None:
        return {"rotary_base": theta, "rope_type": "rope"}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "yarn":
        raise DeepSeekConversionError(f"--in: config.json has rope scaling type {kind!r}; ptdp's multi-latent "
                                      "attention supports none (default) and 'yarn'")
    if scaling.get("attention_factor") is not None or scaling.get("truncate", True) is False:
        raise DeepSeekConversionError("--in: config.json sets yarn attention_factor or truncate=false; ptdp "
                                      "derives the factor from mscale and rounds the ramp as Megatron-Core")
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or hf_config["max_position_embeddings"] / original)
    mscale, all_dim = float(scaling.get("mscale") or 0.0), float(scaling.get("mscale_all_dim") or 0.0)
    if not (mscale and all_dim):  # HF's table scale is then mscale(factor), with 1: ptdp's with --mscale 1
        mscale = 1.0
    return {"rotary_base": theta, "rope_type": "yarn", "rotary_scaling_factor": factor, "mscale": mscale,
            "mscale_all_dim": all_dim, "original_max_position_embeddings": original,
            "beta_fast": float(scaling.get("beta_fast") or 32.0), "beta_slow": float(scaling.get("beta_slow") or 1.0)}


def model_config_from_hf(hf_config: dict) -> tuple[ModelConfig, MoEConfig]:
    """ptdp's model and MoE flags for an HF DeepSeek-V3 ``config.json``; refuses what ptdp does not compute."""
    a = hf_config["num_attention_heads"]
    checks = [("hidden_act", hf_config.get("hidden_act", "silu") == "silu", "'silu'"),
              ("attention_bias", not hf_config.get("attention_bias"), "false"),
              ("rope_interleave", hf_config.get("rope_interleave", True), "true"),
              ("num_key_value_heads", (hf_config.get("num_key_value_heads") or a) == a, "num_attention_heads"),
              ("rms_norm_eps", hf_config.get("rms_norm_eps", 1e-6) == LATENT_NORM_EPS, "1e-6 (HF's latent norms' eps)")]
    for key, ok, wanted in checks:
        if not ok:
            raise DeepSeekConversionError(f"--in: config.json has {key}={hf_config.get(key)!r}; ptdp's DeepSeek-V3 "
                                          f"needs {wanted}")
    base = {**hf_config, "intermediate_size": hf_config["intermediate_size"], "head_dim": None,
            "rope_parameters": None, "rope_scaling": None}
    llama = hf_llama.model_config_from_hf(base)
    n, k = hf_config["num_hidden_layers"], hf_config.get("first_k_dense_replace") or 0
    topk, experts = hf_config["num_experts_per_tok"], hf_config["n_routed_experts"]
    if bool(hf_config.get("norm_topk_prob", True)) != (topk > 1):
        raise DeepSeekConversionError(f"--in: config.json has norm_topk_prob={hf_config.get('norm_topk_prob')!r} "
                                      f"with {topk} experts per token; ptdp normalises the weights iff k > 1")
    groups, group_topk = hf_config.get("n_group") or 1, hf_config.get("topk_group") or 1
    if groups > 1 and topk // group_topk != 2:
        raise DeepSeekConversionError(f"--in: config.json ranks groups by their top 2 scores, ptdp by their top "
                                      f"num_experts_per_tok / topk_group = {topk // group_topk}")
    shared = (hf_config.get("n_shared_experts") or 0) * hf_config["moe_intermediate_size"]
    scaling = float(hf_config.get("routed_scaling_factor") or 1.0)
    moe = MoEConfig(
        num_experts=experts if k < n else None, moe_router_topk=topk,
        moe_ffn_hidden_size=hf_config["moe_intermediate_size"],
        moe_layer_freq=f"([0]*{k}+[1]*{n - k})" if k else "1", moe_shared_expert_intermediate_size=shared or None,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_num_groups=groups if groups > 1 else None, moe_router_group_topk=group_topk if groups > 1 else None,
        moe_router_topk_scaling_factor=scaling if scaling != 1.0 else None)
    cfg = ModelConfig(**{
        **{f: getattr(llama, f) for f in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                                          "seq_length", "max_position_embeddings", "hidden_dropout",
                                          "attention_dropout", "init_method_std",
                                          "norm_epsilon", "vocab_size", "position_embedding_type", "normalization",
                                          "swiglu", "untie_embeddings_and_output_weights", "disable_bias_linear")},
        "multi_latent_attention": True, "q_lora_rank": hf_config.get("q_lora_rank"),
        "kv_lora_rank": hf_config["kv_lora_rank"], "qk_head_dim": hf_config["qk_nope_head_dim"],
        "qk_pos_emb_head_dim": hf_config["qk_rope_head_dim"], "v_head_dim": hf_config["v_head_dim"],
        **_yarn(hf_config)})
    return cfg, moe


def with_mtp(cfg: ModelConfig, moe: MoEConfig, hf_config: dict, tensors: Collection[str]) -> ModelConfig:
    """``cfg`` with the MTP modules the checkpoint holds (``num_nextn_predict_layers`` of them, when their
    tensors are there: HF's random models have none)."""
    import dataclasses

    depth = int(hf_config.get("num_nextn_predict_layers") or 0)
    if not depth or f"{P}layers.{cfg.num_layers}.eh_proj.weight" not in tensors:
        return cfg
    if not moe.num_experts:
        raise DeepSeekConversionError("--in: the checkpoint's MTP modules follow a model without experts; ptdp "
                                      "imports the MTP modules of DeepSeek-V3 models with experts")
    return dataclasses.replace(cfg, mtp_num_layers=depth)


def hf_config_kwargs(cfg: ModelConfig, moe: MoEConfig, bos: int | None, eos: int | None) -> dict[str, Any]:
    """``DeepseekV3Config`` keyword arguments that make HF compute what ptdp computes."""
    pattern = _pattern(cfg, moe)
    rope: dict[str, Any] = {"rope_theta": cfg.rotary_base, "rope_type": "default"}
    if rope_type(cfg) == "yarn" and cfg.rotary_scaling_factor != 1.0:
        rope = {**rope, "rope_type": "yarn", "factor": cfg.rotary_scaling_factor, "mscale": cfg.mscale,
                "mscale_all_dim": cfg.mscale_all_dim, "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow,
                "original_max_position_embeddings": cfg.original_max_position_embeddings}
    ffn = _expert_ffn(cfg, moe) if moe.num_experts else cfg.ffn_size
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size,
        "moe_intermediate_size": ffn, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
        "n_shared_experts": (moe.moe_shared_expert_intermediate_size or ffn) // ffn,
        "n_routed_experts": moe.num_experts or 2, "routed_scaling_factor": moe.moe_router_topk_scaling_factor or 1.0,
        "kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": cfg.q_lora_rank, "qk_rope_head_dim": cfg.qk_pos_emb_head_dim,
        "v_head_dim": cfg.v_head_dim, "qk_nope_head_dim": cfg.qk_head_dim,
        "n_group": moe.moe_router_num_groups or 1, "topk_group": moe.moe_router_group_topk or 1,
        "num_experts_per_tok": moe.moe_router_topk if moe.num_experts else 1,
        "first_k_dense_replace": pattern.index(True) if any(pattern) else cfg.num_layers,
        "norm_topk_prob": moe.moe_router_topk > 1 if moe.num_experts else True, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings or cfg.seq_length, "initializer_range": cfg.init_method_std,
        "rms_norm_eps": cfg.norm_epsilon, "rope_parameters": rope, "rope_interleave": True, "attention_bias": False,
        "attention_dropout": cfg.attention_dropout, "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
        "num_nextn_predict_layers": cfg.mtp_num_layers or 0, "bos_token_id": bos, "eos_token_id": eos,
        "pad_token_id": None, "architectures": ["DeepseekV3ForCausalLM"],
    }


def import_model(hf_config: dict, hf: dict[str, torch.Tensor]) -> tuple[ModelConfig, MoEConfig, dict[str, torch.Tensor]]:
    """The flags and ptdp tensors of an HF DeepSeek-V3 checkpoint (``config.json`` and its tensors)."""
    cfg, moe = model_config_from_hf(hf_config)
    cfg = with_mtp(cfg, moe, hf_config, hf)
    return cfg, moe, from_hf_state(hf, cfg, moe)

