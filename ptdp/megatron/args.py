"""Megatron-LM's run arguments (the ``args`` a checkpoint carries) to and from ptdp's model flags.

Torch-free: the import reads ``args`` (an ``argparse.Namespace`` turned into a dict) and decides, before any
tensor is read, whether ptdp computes the same model. Everything that would change the function (another
activation, a norm ptdp lacks, an attention variant) is refused with one line naming Megatron's argument,
so a checkpoint never imports as a different model.

GeLU: Megatron-Core's MLP computes the tanh approximation only in its fused bias-GeLU (``bias_gelu_fusion``,
on by default, active only with linear biases) and the exact erf ``F.gelu`` otherwise; ``openai_gelu`` is
read by Megatron-LM's legacy models only (``use_legacy_models``), where it means the tanh form. The import
sets ptdp's same-named flags so that ``ModelConfig.gelu_approximate`` is what the checkpoint computed; the
export writes them so that Megatron-Core computes ptdp's GeLU, and refuses the one ptdp model it cannot: a
tanh GeLU without biases (``--openai-gelu --disable-bias-linear``).
"""

from __future__ import annotations

from typing import Any

from ptdp.config import ConfigError, ModelConfig, MoEConfig


class MegatronError(ConfigError):
    """A Megatron-LM checkpoint ptdp cannot read or compute exactly; one line naming the key, file or arg."""


# Megatron-LM args -> the ModelConfig field of the same meaning (copied when present and not None)
_SAME = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
         "max_position_embeddings", "norm_epsilon", "rotary_base", "rotary_percent", "use_rope_scaling",
         "rope_scaling_factor", "swiglu", "untie_embeddings_and_output_weights", "add_qkv_bias", "kv_channels",
         "qk_layernorm", "make_vocab_size_divisible_by", "init_method_std", "hidden_dropout", "attention_dropout")

# Megatron-LM args -> the MoEConfig field of the same meaning
_MOE_SAME = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
             "moe_shared_expert_gate",
             "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_pre_softmax",
             "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
             "moe_router_num_groups", "moe_router_group_topk", "moe_grouped_gemm")

# arg -> (value ptdp computes, why): any other value is refused
_MUST_BE: dict[str, tuple[Any, str]] = {
    "squared_relu": (False, "squared ReLU MLPs"),
    "apply_layernorm_1p": (False, "zero-centred LayerNorm weights"),
    "rotary_interleaved": (False, "RoPE over adjacent dimension pairs (ptdp rotates halves)"),
    "multi_latent_attention": (False, "multi-latent attention from Megatron checkpoints"),
    "mtp_num_layers": (None, "multi-token prediction from Megatron checkpoints"),
    "moe_shared_expert_overlap": (False, None),
    "moe_layer_freq": (1, "MoE layers other than every layer from Megatron checkpoints"),
    "moe_expert_capacity_factor": (None, "expert capacity (token dropping)"),
    "heterogeneous_layers_config_path": (None, "heterogeneous layers"),
    "num_experts_per_layer": (None, None),
    "experimental_attention_variant": (None, "attention variants"),
    "window_size": (None, "sliding-window attention from Megatron checkpoints"),
    "softmax_type": ("vanilla", "attention sinks / other softmax types"),
    "add_bias_linear_expert": (None, None),
}


def _refusal(name: str, value: Any, why: str | None) -> MegatronError:
    what = f" ({why})" if why else ""
    return MegatronError(f"--in: the checkpoint's args set {name}={value!r}; ptdp does not compute that{what}")


def model_from_args(args: dict[str, Any]) -> tuple[ModelConfig, MoEConfig]:
    """ptdp's model flags for Megatron-LM ``args``; :class:`MegatronError` naming the first arg ptdp cannot
    compute exactly."""
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        if not args.get(name):
            raise MegatronError(f"--in: the checkpoint's args lack {name}; is it a Megatron-LM GPT checkpoint?")
    for name, (allowed, why) in _MUST_BE.items():
        value = args.get(name, allowed)
        if value is not None and value != allowed and not (allowed is None and not value):
            raise _refusal(name, value, why)
    cfg = ModelConfig(**{k: args[k] for k in _SAME if args.get(k) is not None})
    cfg.normalization = args.get("normalization", "LayerNorm")
    if cfg.normalization not in ("LayerNorm", "RMSNorm"):
        raise _refusal("normalization", cfg.normalization, None)
    position = args.get("position_embedding_type", "learned_absolute")
    if position not in ("learned_absolute", "rope"):
        raise _refusal("position_embedding_type", position, None)
    cfg.position_embedding_type = position
    if position == "rope" and args.get("rope_type") not in (None, "rope"):
        raise _refusal("rope_type", args["rope_type"], None)
    bias = bool(args.get("add_bias_linear", True))
    cfg.disable_bias_linear = not bias
    if not cfg.swiglu:  # the GeLU form the checkpoint's model computed (tanh or exact), as ptdp's flags
        cfg.bias_gelu_fusion = not bias or bool(args.get("bias_gelu_fusion", True))  # no biases: exact either way
        cfg.openai_gelu = bool(args.get("use_legacy_models")) and bool(args.get("openai_gelu"))
    heads, groups = cfg.num_attention_heads, args.get("num_query_groups")
    if args.get("group_query_attention") and groups and groups != heads:
        cfg.group_query_attention, cfg.num_query_groups = True, int(groups)
    if cfg.kv_channels == cfg.hidden_size // heads:
        cfg.kv_channels = None
    if cfg.ffn_hidden_size is None:
        cfg.ffn_hidden_size = 4 * cfg.hidden_size
    vocab = args.get("vocab_size") or args.get("padded_vocab_size")
    if not vocab:
        raise MegatronError("--in: the checkpoint's args lack padded_vocab_size; is it a Megatron-LM GPT checkpoint?")
    cfg.vocab_size = int(vocab)
    moe = MoEConfig(**{k: args[k] for k in _MOE_SAME if args.get(k) is not None})
    return cfg, moe


def args_from_model(cfg: ModelConfig, moe: MoEConfig, padded_vocab: int) -> dict[str, Any]:
    """Megatron-LM ``args`` for ptdp's model (the inverse of :func:`model_from_args`): what an export's
    ``common.pt`` carries, so Megatron-LM's ``--use-checkpoint-args`` rebuilds the same model."""
    args: dict[str, Any] = {name: getattr(cfg, name) for name in _SAME}
    args.update(
        ffn_hidden_size=cfg.ffn_size, normalization=cfg.normalization, position_embedding_type=cfg.position_embedding_type,
        add_bias_linear=not cfg.disable_bias_linear, group_query_attention=cfg.group_query_attention,
        num_query_groups=cfg.query_groups, kv_channels=cfg.head_dim, openai_gelu=cfg.openai_gelu,
        bias_gelu_fusion=cfg.add_bias_linear and (cfg.swiglu or cfg.gelu_approximate == "tanh"),
        padded_vocab_size=padded_vocab, vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings or cfg.seq_length,
    )
    if moe.num_experts:
        args.update({name: getattr(moe, name) for name in _MOE_SAME})
    return args


def export_problem(cfg: ModelConfig, moe: MoEConfig) -> str | None:
    """Why ptdp's model has no Megatron-Core equivalent this export writes (None: it has one)."""
    from ptdp.models.llama.hf import gemma_options

    if gemma_options(cfg):
        return "the model uses Gemma 3 blocks (sliding windows, sandwich norms, GeGLU, ...), which this export lacks"
    if cfg.multi_latent_attention or cfg.mtp_num_layers:
        return "multi-latent attention and multi-token prediction do not export to Megatron checkpoints yet"
    if not cfg.gated_mlp and cfg.gelu_approximate == "tanh" and cfg.disable_bias_linear:
        return ("a tanh GeLU without linear biases (--openai-gelu with --disable-bias-linear): Megatron-Core "
                "computes it only in its fused bias-GeLU, and the exact GeLU without biases")
    if cfg.use_rope_scaling:
        return "--use-rope-scaling does not export to Megatron checkpoints yet"
    if moe.num_experts and (moe.moe_layer_freq != "1" or moe.moe_shared_expert_gate):
        return "MoE layers other than every layer, and gated shared experts, do not export to Megatron checkpoints"
    return None
