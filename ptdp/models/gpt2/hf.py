"""Hugging Face ``GPT2LMHeadModel`` import and export (``ptdp import/export --format hf``).

ptdp's GPT *is* the GPT-2 architecture (pre-LN, learned positions, GeLU MLP, tied embedding; see
ptdp/models/gpt.py), so conversion is a renaming plus three layout changes:

- HF GPT-2 uses ``Conv1D`` layers whose weights are ``[in, out]``; ptdp's linears are ``[out, in]``.
- ptdp's fused QKV weight is ``[3, h, h]`` (q, k, v blocks, heads contiguous in each) and HF's ``c_attn``
  is ``[h, 3h]`` with the same q|k|v column order, so it is a flatten and a transpose.
- HF's ``activation_function`` is ptdp's GeLU form: ``gelu_new``/``gelu_pytorch_tanh`` (GPT-2's) the tanh
  approximation, ptdp's default with biases; ``gelu`` the exact erf GeLU, ``--no-bias-gelu-fusion``.
- ptdp pads the vocabulary (``--make-vocab-size-divisible-by``, and t); HF holds only the real rows.
  Token ids are not remapped: the byte-level tokenizer's ids are the model's ids on both sides.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ptdp.config import ConfigError, ModelConfig

if TYPE_CHECKING:
    import torch

EMBEDDING = "embedding.word_embeddings.weight"
HF_PREFIX = "transformer."
# HF activations that are exactly ptdp's GeLU with the tanh approximation, and with none (the erf form).
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
EXACT_GELUS = ("gelu", "gelu_python")

# ptdp name suffix inside layers.N -> (HF name suffix inside h.N, whether the weight is transposed)
_LAYER_MAP = {
    "input_layernorm.weight": ("ln_1.weight", False),
    "input_layernorm.bias": ("ln_1.bias", False),
    "attention.qkv.weight": ("attn.c_attn.weight", True),
    "attention.qkv.bias": ("attn.c_attn.bias", False),
    "attention.proj.weight": ("attn.c_proj.weight", True),
    "attention.proj.bias": ("attn.c_proj.bias", False),
    "post_attention_layernorm.weight": ("ln_2.weight", False),
    "post_attention_layernorm.bias": ("ln_2.bias", False),
    "mlp.fc1.weight": ("mlp.c_fc.weight", True),
    "mlp.fc1.bias": ("mlp.c_fc.bias", False),
    "mlp.fc2.weight": ("mlp.c_proj.weight", True),
    "mlp.fc2.bias": ("mlp.c_proj.bias", False),
}
_TOP_MAP = {
    "embedding.position_embeddings.weight": "wpe.weight",
    "final_layernorm.weight": "ln_f.weight",
    "final_layernorm.bias": "ln_f.bias",
}


class GPT2ConversionError(ConfigError):
    """Something in the model or its files that ptdp's GPT-2 cannot represent; one line."""


def is_gpt2(cfg: ModelConfig) -> bool:
    """Whether ``cfg`` is the GPT-2 architecture HF's ``GPT2LMHeadModel`` computes."""
    return (cfg.position_embedding_type == "learned_absolute" and cfg.normalization == "LayerNorm"
            and not cfg.swiglu and not cfg.group_query_attention and cfg.tied_embeddings
            and not cfg.disable_bias_linear and not cfg.disable_bias_norm and cfg.head_dim * cfg.num_attention_heads == cfg.hidden_size
            and not (cfg.window_size or cfg.sandwich_norm or cfg.apply_layernorm_1p or cfg.scale_embedding or cfg.geglu
                     or cfg.softmax_scale is not None)  # none of Gemma 3's blocks
            and cfg.softmax_type == "vanilla" and not cfg.quick_geglu and not cfg.glu_linear_offset
            and cfg.activation_func_clamp_value is None)  # nor GPT-OSS's



def to_hf_state(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """ptdp full tensors -> HF ``GPT2LMHeadModel`` tensors (``transformer.*``; ``lm_head`` is tied)."""
    import torch

    vocab, h = cfg.vocab_size, cfg.hidden_size
    out = {HF_PREFIX + "wte.weight": tensors[EMBEDDING][:vocab]}  # drop the padding rows
    for name, hf_name in _TOP_MAP.items():
        out[HF_PREFIX + hf_name] = tensors[name]
    for i in range(cfg.num_layers):
        for suffix, (hf_suffix, transpose) in _LAYER_MAP.items():
            value = tensors[f"layers.{i}.{suffix}"]
            if suffix.startswith("attention.qkv"):
                value = value.reshape(3 * h, h) if transpose else value.reshape(3 * h)
            out[f"{HF_PREFIX}h.{i}.{hf_suffix}"] = value.t() if transpose else value
    return {k: v.detach().to(torch.float32).contiguous() for k, v in out.items()}


def hf_config_dict(cfg: ModelConfig, eos_token_id: int | None) -> dict:
    """``GPT2Config`` keyword arguments that make HF compute exactly what ptdp computes."""
    return {
        "vocab_size": cfg.vocab_size, "n_positions": cfg.max_position_embeddings or cfg.seq_length, "n_embd": cfg.hidden_size,
        "n_layer": cfg.num_layers, "n_head": cfg.num_attention_heads, "n_inner": cfg.ffn_size,
        "activation_function": "gelu_new" if cfg.gelu_approximate == "tanh" else "gelu", "layer_norm_epsilon": cfg.norm_epsilon,
        "resid_pdrop": cfg.hidden_dropout, "embd_pdrop": cfg.hidden_dropout,
        "attn_pdrop": cfg.attention_dropout,
        "initializer_range": cfg.init_method_std, "tie_word_embeddings": True,
        "bos_token_id": eos_token_id, "eos_token_id": eos_token_id,
        "architectures": ["GPT2LMHeadModel"],
    }



def gpt2_recipes(cfg: ModelConfig, padded_vocab: int) -> dict:
    """Per ptdp parameter, its recipe over ``GPT2LMHeadModel`` tensors (``ptdp.models.hf_recipe``): the
    ``Conv1D`` weights transposed, ``c_attn`` (``[h, 3h]``) transposed and viewed as ptdp's ``[3, h, h]``
    (its bias ``[3h]`` as ``[3, h]``), the embedding padded with zero rows to ``padded_vocab``. Import,
    ``--load HF_DIR`` and export all run this one mapping."""
    from ptdp.models.hf_recipe import Cat, Take, Transpose, Unflatten, Zeros

    vocab, h = cfg.vocab_size, cfg.hidden_size
    pad = (Zeros((padded_vocab - vocab, h)),) if padded_vocab > vocab else ()
    out: dict = {EMBEDDING: Cat((Take(HF_PREFIX + "wte.weight"), *pad))}
    out.update({name: Take(HF_PREFIX + hf_name) for name, hf_name in _TOP_MAP.items()})
    for i in range(cfg.num_layers):
        for suffix, (hf_suffix, transpose) in _LAYER_MAP.items():
            recipe = Take(f"{HF_PREFIX}h.{i}.{hf_suffix}")
            recipe = Transpose(recipe) if transpose else recipe
            out[f"layers.{i}.{suffix}"] = Unflatten(recipe, 3) if suffix.startswith("attention.qkv") else recipe
    return out


def from_hf_state(hf_tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF GPT-2 tensors (with or without the ``transformer.`` prefix) -> ptdp full tensors, unpadded
    (``write_full_model_state`` pads the embedding): :func:`gpt2_recipes` evaluated whole."""
    from ptdp.models.hf_recipe import RecipeError
    from ptdp.models.hf_tensors import materialize

    hf = {HF_PREFIX + k.removeprefix(HF_PREFIX): v for k, v in hf_tensors.items()}
    recipes = gpt2_recipes(cfg, cfg.vocab_size)
    recipes[EMBEDDING] = recipes[EMBEDDING].parts[0]
    try:
        return materialize(recipes, hf)
    except RecipeError as e:
        raise GPT2ConversionError(f"--in: {e}; is it a GPT-2 model?") from None


def model_config_from_hf(hf_config: dict) -> ModelConfig:
    """ptdp's model flags for an HF GPT-2 ``config.json``; refuses variants ptdp does not compute."""
    by_layer_idx = hf_config.get("scale_attn_by_inverse_layer_idx", False)
    activation = hf_config.get("activation_function", "gelu_new")
    checks = [
        ("activation_function", activation in TANH_GELUS + EXACT_GELUS, "gelu_new, gelu_pytorch_tanh or gelu"),
        ("scale_attn_weights", hf_config.get("scale_attn_weights", True), "true"),
        ("scale_attn_by_inverse_layer_idx", not by_layer_idx, "false"),
        ("add_cross_attention", not hf_config.get("add_cross_attention", False), "false"),
        ("tie_word_embeddings", hf_config.get("tie_word_embeddings", True), "true"),
    ]
    for key, ok, wanted in checks:
        if not ok:
            raise GPT2ConversionError(f"--in: config.json has {key}={hf_config.get(key)!r}; ptdp's GPT needs {wanted}")
    n_embd = hf_config["n_embd"]
    return ModelConfig(
        num_layers=hf_config["n_layer"], hidden_size=n_embd, num_attention_heads=hf_config["n_head"],
        ffn_hidden_size=hf_config.get("n_inner") or 4 * n_embd, seq_length=hf_config["n_positions"],
        max_position_embeddings=hf_config["n_positions"],
        hidden_dropout=hf_config.get("resid_pdrop", 0.1), attention_dropout=hf_config.get("attn_pdrop", 0.1),
        init_method_std=hf_config.get("initializer_range", 0.02),
        norm_epsilon=hf_config.get("layer_norm_epsilon", 1e-5), vocab_size=hf_config["vocab_size"],
        bias_gelu_fusion=activation in TANH_GELUS,  # off: the exact GeLU (GPT-2 has biases)
    )
