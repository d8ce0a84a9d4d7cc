"""Hugging Face ``LlamaForCausalLM`` export and import (``ptdp export/import --format hf``, through the family
registry; Mixtral, Qwen2-MoE, Qwen3 and DeepSeek-V3 convert their Llama parts here).

ptdp's Llama options compute what HF's Llama computes (ptdp/models/gpt.py), so conversion is renaming plus
three layout changes:

- QKV: HF keeps ``q_proj [a·d, h]``, ``k_proj [G·d, h]``, ``v_proj [G·d, h]``. ptdp fuses them: without
  GQA ``[3, a·d, h]`` (q, k, v blocks); with GQA ``[(a + 2G)·d, h]`` ordered per key/value group (its a/G
  query heads, its key head, its value head). HF's query head j uses group ``j // (a/G)`` (``repeat_kv``),
  the same grouping.
- MLP: ptdp's ``fc1`` is ``[2, ffn, h]`` = (gate_proj, up_proj); ``fc2`` is ``down_proj``.
- Vocabulary: ptdp pads the embedding and the untied output layer; HF holds only the real rows.

Rotary embeddings: HF's checkpoints use the rotate-half convention, as ptdp does, so q and k need no
permutation (Meta's original ``consolidated.*.pth`` files pair adjacent dimensions; convert them with HF's
script first). ``rope_theta`` is ``--rotary-base``; the llama3 rope scaling is ``--use-rope-scaling
--rope-scaling-factor F`` with Llama 3.1's published low/high frequency factors (1, 4) and original
context (8192). Anything ptdp does not compute — other rope scaling types, sliding windows, linear biases,
activations other than SiLU — is refused with one line instead of converting into a different model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ptdp.config import ConfigError, ModelConfig, MoEConfig

if TYPE_CHECKING:
    import torch

    from ptdp.models import hf_recipe

EMBEDDING = "embedding.word_embeddings.weight"
LM_HEAD = "lm_head.weight"
HF_PREFIX = "model."

_LAYER_MAP = {  # ptdp suffix inside layers.N -> HF suffix inside model.layers.N (same shapes)
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "attention.proj.weight": "self_attn.o_proj.weight",
    "mlp.fc2.weight": "mlp.down_proj.weight",
}


class LlamaConversionError(ConfigError):
    """Something in the model or its files that ptdp's Llama cannot represent; one line."""


def is_llama(cfg: ModelConfig) -> bool:
    """Whether ``cfg`` is a model HF's ``LlamaForCausalLM`` computes exactly."""
    return (cfg.position_embedding_type == "rope" and cfg.normalization == "RMSNorm" and cfg.swiglu
            and cfg.disable_bias_linear and not cfg.add_qkv_bias and cfg.rotary_percent == 1.0
            and not cfg.qk_layernorm and not cfg.multi_latent_attention and not gemma_options(cfg)
            and not gpt_oss_options(cfg) and not cfg.attention_output_gate
            and cfg.experimental_attention_variant is None)


def gpt_oss_options(cfg: ModelConfig) -> bool:
    """Whether ``cfg`` uses any of the blocks GPT-OSS added (sinks, the clamped quick-GeGLU, YaRN without MLA)."""
    return bool(cfg.softmax_type != "vanilla" or cfg.quick_geglu or cfg.glu_linear_offset
                or cfg.activation_func_clamp_value is not None or cfg.rope_type == "yarn")


def gemma_options(cfg: ModelConfig) -> bool:
    """Whether ``cfg`` uses any of the blocks Gemma 3 added (no Llama, Qwen3 or DeepSeek-V3 has them)."""
    return bool(cfg.window_size or cfg.sandwich_norm or cfg.apply_layernorm_1p or cfg.scale_embedding or cfg.geglu
                or cfg.softmax_scale is not None or cfg.local_rotary_base is not None
                or cfg.attn_logit_softcapping is not None or cfg.final_logit_softcapping is not None)


def _split_qkv(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a, g, d, h = cfg.num_attention_heads, cfg.query_groups, cfg.head_dim, cfg.hidden_size
    if not cfg.group_query_attention:
        return qkv[0], qkv[1], qkv[2]
    groups = qkv.view(g, a // g + 2, d, h)
    return groups[:, :-2].reshape(a * d, h), groups[:, -2].reshape(g * d, h), groups[:, -1].reshape(g * d, h)


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    import torch

    a, g, d, h = cfg.num_attention_heads, cfg.query_groups, cfg.head_dim, cfg.hidden_size
    if not cfg.group_query_attention:
        return torch.stack([q, k, v])
    groups = torch.cat([q.view(g, a // g, d, h), k.view(g, 1, d, h), v.view(g, 1, d, h)], dim=1)
    return groups.reshape((a + 2 * g) * d, h)


def to_hf_state(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """ptdp full tensors -> ``LlamaForCausalLM`` tensors (``lm_head.weight`` only when untied)."""
    import torch

    vocab = cfg.vocab_size
    out = {HF_PREFIX + "embed_tokens.weight": tensors[EMBEDDING][:vocab],
           HF_PREFIX + "norm.weight": tensors["final_layernorm.weight"]}
    if cfg.untie_embeddings_and_output_weights:
        out[LM_HEAD] = tensors[LM_HEAD][:vocab]
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}.", f"{HF_PREFIX}layers.{i}."
        for suffix, hf_suffix in _LAYER_MAP.items():
            out[theirs + hf_suffix] = tensors[ours + suffix]
        q, k, v = _split_qkv(tensors[ours + "attention.qkv.weight"], cfg)
        out.update({theirs + "self_attn.q_proj.weight": q, theirs + "self_attn.k_proj.weight": k,
                    theirs + "self_attn.v_proj.weight": v})
        gate, up = tensors[ours + "mlp.fc1.weight"]
        out.update({theirs + "mlp.gate_proj.weight": gate, theirs + "mlp.up_proj.weight": up})
    return {k: v.detach().to(torch.float32).contiguous() for k, v in out.items()}


def hf_recipes(cfg: ModelConfig, padded_vocab: int) -> dict[str, hf_recipe.Recipe]:
    """Per ptdp parameter, how it is built from ``LlamaForCausalLM`` tensors (``ptdp.models.hf_recipe``):
    the vocabulary (and the untied output layer) padded with zero rows to ``padded_vocab``, the QKV fused,
    gate and up stacked. Import, ``--load HF_DIR`` and export all run this one mapping."""
    from ptdp.models.hf_recipe import Cat, Stack, Take, Zeros

    vocab, h = cfg.vocab_size, cfg.hidden_size
    pad = (Zeros((padded_vocab - vocab, h)),) if padded_vocab > vocab else ()
    out: dict[str, hf_recipe.Recipe] = {EMBEDDING: Cat((Take(HF_PREFIX + "embed_tokens.weight"), *pad)),
                                        "final_layernorm.weight": Take(HF_PREFIX + "norm.weight")}
    if cfg.untie_embeddings_and_output_weights:
        out[LM_HEAD] = Cat((Take(LM_HEAD), *pad))
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}.", f"{HF_PREFIX}layers.{i}."
        for suffix, hf_suffix in _LAYER_MAP.items():
            out[ours + suffix] = Take(theirs + hf_suffix)
        out[ours + "attention.qkv.weight"] = qkv_recipe(cfg, theirs, "weight")
        out[ours + "mlp.fc1.weight"] = Stack((Take(theirs + "mlp.gate_proj.weight"), Take(theirs + "mlp.up_proj.weight")))
    return out


def qkv_recipe(cfg: ModelConfig, layer: str, suffix: str) -> hf_recipe.Recipe:
    """ptdp's fused QKV ``suffix`` ("weight" or "bias") of HF layer ``layer`` (its ``model.layers.N.``):
    with GQA per group its a/G query heads, its key head, its value head; else q, k, v stacked. A bias is
    cut along the same rows as its weight."""
    from ptdp.models.hf_recipe import Cat, Stack, Take

    a, g, d = cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
    q, k, v = (f"{layer}self_attn.{x}_proj.{suffix}" for x in "qkv")
    if not cfg.group_query_attention:
        return Stack((Take(q), Take(k), Take(v)))
    per = a // g * d
    return Cat(tuple(part for j in range(g) for part in (
        Take(q, (j * per, (j + 1) * per)), Take(k, (j * d, (j + 1) * d)), Take(v, (j * d, (j + 1) * d)))))


def import_state(recipes_for: Callable[[int], dict], hf: dict[str, torch.Tensor], cfg: ModelConfig,
                 error: Callable[[str], Exception]) -> dict[str, torch.Tensor]:
    """``ptdp import`` of any family built on Llama's vocabulary layout: ``recipes_for(padded_vocab)``
    evaluated over the whole of ``hf``, the untied output layer padded like the embedding (the embedding
    left unpadded: ``write_full_model_state`` pads it); a missing tensor raises ``error(message)``."""
    from ptdp.models.hf_recipe import Cat, RecipeError
    from ptdp.models.hf_tensors import materialize

    head = hf.get(LM_HEAD)
    recipes = recipes_for(cfg.padded_vocab_size(head.shape[0] if head is not None else cfg.vocab_size, 1))
    embedding = recipes[EMBEDDING]
    recipes[EMBEDDING] = embedding.parts[0] if isinstance(embedding, Cat) else embedding
    try:
        return materialize(recipes, hf)
    except RecipeError as e:
        raise error(str(e)) from None


def recipe_read(model_of: Callable[[dict], tuple[ModelConfig, MoEConfig]],
                recipes_of: Callable[[ModelConfig, MoEConfig, int], dict], error: Callable[[str], Exception]):
    """A family's ``read`` (``ptdp import``) that is its recipes evaluated whole: ``model_of(config_json)``
    gives the flags, :func:`import_state` the tensors; a missing tensor raises ``error(message)``."""

    def read(hf_config: dict, hf: dict[str, torch.Tensor]) -> tuple[ModelConfig, MoEConfig, dict]:
        cfg, moe = model_of(hf_config)
        return cfg, moe, import_state(lambda padded: recipes_of(cfg, moe, padded), hf, cfg, error)

    return read


def recipe_write(recipes_of: Callable[[ModelConfig, MoEConfig, int], dict]):
    """A family's ``write`` (whole-model export) that is its recipes run backwards, into fp32 HF tensors."""

    def write(tensors: dict[str, torch.Tensor], cfg: ModelConfig, moe: MoEConfig) -> dict[str, torch.Tensor]:
        import torch

        from ptdp.models.hf_tensors import unmaterialize

        recipes = recipes_of(cfg, moe, tensors[EMBEDDING].shape[0])
        return {k: v.detach().to(torch.float32).contiguous() for k, v in unmaterialize(recipes, tensors).items()}

    return write


def from_hf_state(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``LlamaForCausalLM`` tensors -> ptdp full tensors (:func:`hf_recipes`, evaluated whole)."""
    return import_state(lambda padded: hf_recipes(cfg, padded), hf, cfg,
                        lambda e: LlamaConversionError(f"--in: {e}; is it a LlamaForCausalLM?"))


def _rope(hf_config: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling parameters or None) from a transformers 4.x (``rope_theta``, ``rope_scaling``) or
    5.x (``rope_parameters``) config."""
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf_config.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    return float(theta), (None if kind == "default" else params)


def model_config_from_hf(hf_config: dict) -> ModelConfig:
    """ptdp's model flags for an HF Llama ``config.json``; refuses what ptdp does not compute."""
    if hf_config.get("hidden_act", "silu") != "silu":
        raise LlamaConversionError(f"--in: config.json has hidden_act={hf_config['hidden_act']!r}; ptdp's "
                                   "SwiGLU needs 'silu'")
    for key in ("attention_bias", "mlp_bias"):
        if hf_config.get(key):
            raise LlamaConversionError(f"--in: config.json has {key}=true; ptdp's Llama has no linear biases")
    if hf_config.get("sliding_window") is not None or hf_config.get("use_sliding_window"):
        raise LlamaConversionError("--in: config.json sets a sliding attention window; ptdp attends to the "
                                   "whole causal context")
    theta, scaling = _rope(hf_config)
    factor = None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        published = _llama3_scaling()
        if kind != "llama3":
            raise LlamaConversionError(f"--in: config.json has rope scaling type {kind!r}; ptdp supports none "
                                       "(default) and 'llama3'")
        odd = {k: scaling.get(k) for k, v in published.items() if float(scaling.get(k, v)) != v}
        if odd:
            raise LlamaConversionError(f"--in: llama3 rope scaling with {odd}; ptdp uses Llama 3.1's {published}")
        factor = float(scaling["factor"])
    h, a = hf_config["hidden_size"], hf_config["num_attention_heads"]
    kv = hf_config.get("num_key_value_heads") or a
    head_dim = hf_config.get("head_dim") or h // a
    return ModelConfig(
        num_layers=hf_config["num_hidden_layers"], hidden_size=h, num_attention_heads=a,
        ffn_hidden_size=hf_config["intermediate_size"], seq_length=hf_config["max_position_embeddings"],
        max_position_embeddings=hf_config["max_position_embeddings"],
        hidden_dropout=0.0, attention_dropout=float(hf_config.get("attention_dropout", 0.0)),
        init_method_std=hf_config.get("initializer_range", 0.02), norm_epsilon=hf_config.get("rms_norm_eps", 1e-6),
        vocab_size=hf_config["vocab_size"], position_embedding_type="rope", rotary_base=theta,
        use_rope_scaling=factor is not None, rope_scaling_factor=factor or 8.0, normalization="RMSNorm",
        swiglu=True, group_query_attention=kv != a, num_query_groups=kv if kv != a else 1,
        untie_embeddings_and_output_weights=not hf_config.get("tie_word_embeddings", False),
        disable_bias_linear=True, kv_channels=head_dim if head_dim != h // a else None,
    )


def hf_config_kwargs(cfg: ModelConfig, bos_token_id: int | None, eos_token_id: int | None) -> dict[str, Any]:
    """``LlamaConfig`` keyword arguments that make HF compute exactly what ptdp computes (the legacy
    ``rope_theta``/``rope_scaling`` spelling, which transformers 4.x and 5.x both accept)."""
    scaling = None
    if cfg.use_rope_scaling:
        scaling = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor,
                   **_llama3_scaling()}
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.query_groups, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings or cfg.seq_length, "rms_norm_eps": cfg.norm_epsilon,
        "rope_theta": cfg.rotary_base, "rope_scaling": scaling, "attention_bias": False, "mlp_bias": False,
        "attention_dropout": cfg.attention_dropout, "initializer_range": cfg.init_method_std,
        "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "architectures": ["LlamaForCausalLM"],
    }


def _llama3_scaling() -> dict[str, float]:
    """Llama 3.1's published frequency scaling, as HF's ``rope_scaling`` names it (``models.rotary`` loads
    torch: imported here, so that ``ptdp --help`` and the parsers stay without it)."""
    from ptdp.models import rotary

    return {"low_freq_factor": rotary.LLAMA3_LOW_FREQ_FACTOR, "high_freq_factor": rotary.LLAMA3_HIGH_FREQ_FACTOR,
            "original_max_position_embeddings": rotary.LLAMA3_ORIGINAL_CONTEXT}
