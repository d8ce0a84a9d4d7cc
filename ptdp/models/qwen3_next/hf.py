"""Hugging Face ``Qwen3NextForCausalLM`` import and export.

The model is ``GPTModel`` with these flags (``qwen3_next_flags``): Gated DeltaNet layers where config.json's
``layer_types`` says ``linear_attention`` (``--experimental-attention-variant gated_delta_net
--linear-attention-freq [1,1,1,0]``, the ``linear_*`` sizes), Qwen3's full attention (``--qk-layernorm``,
GQA, ``head_dim``) with a sigmoid output gate (``--attention-output-gate``) and partial rotary
(``--rotary-percent`` = ``partial_rotary_factor``), zero-centred RMSNorms (``--apply-layernorm-1p``; not the
Gated DeltaNet's own output norm, which starts at 1), an untied output layer, and a Qwen2-MoE-style mixture
of experts with a sigmoid-gated shared expert (``--moe-shared-expert-gate``), dense MLPs where
``mlp_only_layers``/``decoder_sparse_step`` say.

Tensors, as per-tensor recipes (``ptdp.models.hf_recipe``: ``ptdp import``, ``ptdp train --load HF_DIR``,
where each rank reads only its slices, and export run the one mapping). Full attention: HF's ``q_proj`` holds
per head its query rows then its gate rows ``[a, 2, d, h]``; ptdp keeps the queries in the fused QKV (Llama's
layout) and the gates in ``attention.gate``, so each takes its heads' rows of ``q_proj``. Gated DeltaNet:
``in_proj_qkvz``/``in_proj_ba`` (already grouped per key head), ``A_log``, ``dt_bias``, ``norm`` and
``out_proj`` as they are (renamed: ``attention.decay.A_log``, ``attention.out_layernorm``);
``conv1d.weight [C, 1, taps]`` lists all q channels, then all k, then all v, which ptdp regroups per key
head (q, k, v of head 0, then of head 1, ...: the layout a tensor-parallel split cuts in one slice,
``ptdp.models.gated_deltanet``), its middle dimension dropped. Experts: either HF layout is read
(``ptdp.models.mixtral.hf``), the per-expert one written (what ``save_pretrained`` writes).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ptdp.config import ConfigError, ModelConfig, MoEConfig
from ptdp.config.validate_linear import linear_attention_layers
from ptdp.models.llama import hf as llama
from ptdp.models.mixtral import hf as mixtral

if TYPE_CHECKING:
    from ptdp.models import hf_recipe

P = llama.HF_PREFIX
_LINEAR = {"attention.in_proj_qkvz.weight": "linear_attn.in_proj_qkvz.weight",
           "attention.in_proj_ba.weight": "linear_attn.in_proj_ba.weight",
           "attention.decay.A_log": "linear_attn.A_log", "attention.decay.dt_bias": "linear_attn.dt_bias",
           "attention.out_layernorm.weight": "linear_attn.norm.weight",
           "attention.out_proj.weight": "linear_attn.out_proj.weight"}
_FULL = {"attention.proj.weight": "self_attn.o_proj.weight", "attention.q_layernorm.weight": "self_attn.q_norm.weight",
         "attention.k_layernorm.weight": "self_attn.k_norm.weight"}
_NORMS = {"input_layernorm.weight": "input_layernorm.weight",
          "post_attention_layernorm.weight": "post_attention_layernorm.weight"}


class Qwen3NextConversionError(ConfigError):
    """Something in a Qwen3-Next model or its files that ptdp cannot compute exactly; one line."""


def is_qwen3_next(cfg: ModelConfig, moe: MoEConfig) -> bool:
    """Whether HF's ``Qwen3NextForCausalLM`` computes exactly this model."""
    plain = dataclasses.replace(cfg, qk_layernorm=False, apply_layernorm_1p=False, rotary_percent=1.0)
    experts_ok = not moe.num_experts or (
        bool(moe.moe_shared_expert_intermediate_size) and moe.moe_shared_expert_gate
        and moe.moe_router_score_function == "softmax" and not moe.moe_router_enable_expert_bias
        and not moe.moe_router_num_groups and not moe.moe_router_topk_scaling_factor)
    return (cfg.experimental_attention_variant == "gated_delta_net" and cfg.attention_output_gate
            and cfg.qk_layernorm and cfg.apply_layernorm_1p and not cfg.tied_embeddings and experts_ok
            and llama.is_llama(dataclasses.replace(plain, attention_output_gate=False,
                                                   experimental_attention_variant=None)))


def _freq(kinds: list[bool]) -> str:
    """``--linear-attention-freq`` for a per-layer pattern: N where N - 1 linear layers and one full one
    repeat, else the list."""
    for n in range(1, len(kinds) + 1):
        if kinds == [(i + 1) % n != 0 for i in range(len(kinds))]:
            return str(n)
    return str([int(k) for k in kinds]).replace(" ", "")


def _config(hf_config: dict) -> tuple[ModelConfig, MoEConfig]:
    kinds = hf_config.get("layer_types")
    n = hf_config["num_hidden_layers"]
    if kinds is None:
        interval = hf_config.get("full_attention_interval", 4)
        kinds = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    odd = sorted(set(kinds) - {"linear_attention", "full_attention"})
    if odd or len(kinds) != n:
        raise Qwen3NextConversionError(f"--in: config.json has layer_types {odd or kinds}; ptdp reads "
                                       "linear_attention and full_attention, one per layer")
    params = hf_config.get("rope_parameters") or {}
    percent = float(params.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 0.25)))
    base = {k: v for k, v in hf_config.items() if k not in ("layer_types",)}
    cfg = llama.model_config_from_hf(base)
    head_dim = hf_config.get("head_dim") or cfg.hidden_size // cfg.num_attention_heads
    cfg = dataclasses.replace(
        cfg, qk_layernorm=True, apply_layernorm_1p=True, attention_output_gate=True, rotary_percent=percent,
        kv_channels=head_dim, experimental_attention_variant="gated_delta_net",
        linear_attention_freq=_freq([k == "linear_attention" for k in kinds]),
        linear_conv_kernel_dim=hf_config["linear_conv_kernel_dim"], linear_key_head_dim=hf_config["linear_key_head_dim"],
        linear_value_head_dim=hf_config["linear_value_head_dim"], linear_num_key_heads=hf_config["linear_num_key_heads"],
        linear_num_value_heads=hf_config["linear_num_value_heads"])
    if not hf_config.get("num_experts"):
        return cfg, MoEConfig()
    step, dense_only = hf_config.get("decoder_sparse_step") or 1, set(hf_config.get("mlp_only_layers") or [])
    pattern = [int(i not in dense_only and (i + 1) % step == 0) for i in range(n)]
    moe = MoEConfig(num_experts=hf_config["num_experts"], moe_router_topk=hf_config["num_experts_per_tok"],
                    moe_ffn_hidden_size=hf_config["moe_intermediate_size"],
                    moe_layer_freq="1" if all(pattern) else str(pattern).replace(" ", ""),
                    moe_shared_expert_intermediate_size=hf_config["shared_expert_intermediate_size"],
                    moe_shared_expert_gate=True, moe_router_pre_softmax=not hf_config.get("norm_topk_prob", True))
    return cfg, moe


def _conv_recipe(cfg: ModelConfig, name: str) -> hf_recipe.Recipe:
    """ptdp's ``[C, taps]`` convolution from HF's ``[C, 1, taps]`` (all q channels, all k, all v): per key
    head its q, k and v rows."""
    from ptdp.models.hf_recipe import Cat, Squeeze, Take

    nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    vs, key = cfg.linear_num_value_heads // nk * cfg.linear_value_head_dim, nk * dk
    rows = [r for j in range(nk) for r in ((j * dk, (j + 1) * dk), (key + j * dk, key + (j + 1) * dk),
                                           (2 * key + j * vs, 2 * key + (j + 1) * vs))]
    return Squeeze(Cat(tuple(Take(name, r) for r in rows)), 1)


def _attention_recipes(cfg: ModelConfig, ours: str, theirs: str) -> dict[str, hf_recipe.Recipe]:
    """The gated full attention's QKV (Llama's layout) and gate, each from its heads' rows of ``q_proj``."""
    from ptdp.models.hf_recipe import Cat, Stack, Take

    a, g, d = cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
    q, k, v = (f"{theirs}self_attn.{x}_proj.weight" for x in "qkv")

    def heads(lo: int, hi: int, offset: int) -> tuple:  # heads [lo, hi): their query (0) or gate (d) rows
        return tuple(Take(q, (2 * j * d + offset, 2 * j * d + offset + d)) for j in range(lo, hi))

    if cfg.group_query_attention:
        per = a // g
        qkv = Cat(tuple(part for j in range(g) for part in (
            *heads(j * per, (j + 1) * per, 0), Take(k, (j * d, (j + 1) * d)), Take(v, (j * d, (j + 1) * d)))))
    else:
        qkv = Stack((Cat(heads(0, a, 0)), Take(k), Take(v)))
    return {ours + "attention.qkv.weight": qkv, ours + "attention.gate.weight": Cat(heads(0, a, d))}


def _mlp_recipes(moe: MoEConfig, ours: str, theirs: str, sparse: bool) -> dict[str, hf_recipe.Recipe]:
    """A dense MLP, or the router, experts (either layout) and gated shared expert of a sparse layer."""
    from ptdp.models.hf_recipe import Stack, Take

    mlp = f"{theirs}mlp."

    def fc1(prefix: str) -> hf_recipe.Recipe:
        return Stack((Take(prefix + "gate_proj.weight"), Take(prefix + "up_proj.weight")))

    if not sparse:
        return {ours + "mlp.fc1.weight": fc1(mlp), ours + "mlp.fc2.weight": Take(mlp + "down_proj.weight")}
    return {ours + "mlp.router.weight": Take(mlp + "gate.weight"),
            **mixtral.expert_recipes(ours, theirs, moe.num_experts, "qwen3_next"),
            ours + "mlp.shared_expert.fc1.weight": fc1(mlp + "shared_expert."),
            ours + "mlp.shared_expert.fc2.weight": Take(mlp + "shared_expert.down_proj.weight"),
            ours + "mlp.shared_expert_gate.weight": Take(mlp + "shared_expert_gate.weight")}


def qwen3_next_recipes(cfg: ModelConfig, moe: MoEConfig, padded_vocab: int) -> dict[str, hf_recipe.Recipe]:
    """Per ptdp parameter, its recipe over ``Qwen3NextForCausalLM`` tensors: the vocabulary and the untied
    output layer padded with zero rows to ``padded_vocab``, each layer's Gated DeltaNet or gated attention,
    its norms, and its dense MLP or experts."""
    from ptdp.models.hf_recipe import Cat, Take, Zeros

    vocab, h = cfg.vocab_size, cfg.hidden_size
    pad = (Zeros((padded_vocab - vocab, h)),) if padded_vocab > vocab else ()
    out: dict[str, hf_recipe.Recipe] = {llama.EMBEDDING: Cat((Take(P + "embed_tokens.weight"), *pad)),
                                        "final_layernorm.weight": Take(P + "norm.weight")}
    if cfg.untie_embeddings_and_output_weights:
        out[llama.LM_HEAD] = Cat((Take(llama.LM_HEAD), *pad))
    pattern = mixtral._pattern(moe, cfg.num_layers)
    for i, linear in enumerate(linear_attention_layers(cfg)):
        ours, theirs = f"layers.{i}.", f"{P}layers.{i}."
        out.update({ours + k: Take(theirs + v) for k, v in {**_NORMS, **(_LINEAR if linear else _FULL)}.items()})
        if linear:
            out[ours + "attention.conv1d.weight"] = _conv_recipe(cfg, theirs + "linear_attn.conv1d.weight")
        else:
            out.update(_attention_recipes(cfg, ours, theirs))
        out.update(_mlp_recipes(moe, ours, theirs, pattern[i]))
    return out


def qwen3_next_model(hf_config: dict) -> tuple[ModelConfig, MoEConfig]:
    """The model and expert flags of a Qwen3-Next ``config.json``."""
    return _config(hf_config)


# ``ptdp import``: the recipes evaluated whole, over either expert layout; the whole-model export, the
# experts per expert: run backwards.
read_qwen3_next = llama.recipe_read(_config, qwen3_next_recipes,
                                    lambda e: Qwen3NextConversionError(f"--in: {e}; is it a Qwen3-Next model?"))
write_qwen3_next = llama.recipe_write(qwen3_next_recipes)


def qwen3_next_config(cfg: ModelConfig, moe: MoEConfig, bos: int | None, eos: int | None) -> dict[str, Any]:
    """``Qwen3NextConfig`` keyword arguments that make HF compute what ptdp computes."""
    plain = dataclasses.replace(cfg, qk_layernorm=False, apply_layernorm_1p=False, rotary_percent=1.0)
    kwargs = llama.hf_config_kwargs(plain, bos, eos)
    kwargs.pop("mlp_bias")
    kinds = ["linear_attention" if k else "full_attention" for k in linear_attention_layers(cfg)]
    pattern = mixtral._pattern(moe, cfg.num_layers)
    kwargs.pop("rope_theta"), kwargs.pop("rope_scaling")
    return {**kwargs, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base,
                                          "partial_rotary_factor": cfg.rotary_percent},
            "layer_types": kinds, "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim,
            "linear_key_head_dim": cfg.linear_key_head_dim, "linear_value_head_dim": cfg.linear_value_head_dim,
            "linear_num_key_heads": cfg.linear_num_key_heads, "linear_num_value_heads": cfg.linear_num_value_heads,
            "num_experts": moe.num_experts or 0, "num_experts_per_tok": moe.moe_router_topk,
            "moe_intermediate_size": moe.moe_ffn_hidden_size or cfg.ffn_size,
            "shared_expert_intermediate_size": moe.moe_shared_expert_intermediate_size or 0,
            "norm_topk_prob": not moe.moe_router_pre_softmax, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, sparse in enumerate(pattern) if not sparse] if moe.num_experts else [],
            "architectures": ["Qwen3NextForCausalLM"]}


def export_problem(cfg: ModelConfig, moe: MoEConfig) -> str | None:
    return None if not cfg.tied_embeddings else "Qwen3-Next export needs an untied output layer"
