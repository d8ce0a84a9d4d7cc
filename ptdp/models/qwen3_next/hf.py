"""Hugging Face ``Qwen3NextForCausalLM`` import and export.

The model is ``GPTModel`` with these flags (``qwen3_next_flags``): Gated DeltaNet layers where config.json's
``layer_types`` says ``linear_attention`` (``--experimental-attention-variant gated_delta_net
--linear-attention-freq [1,1,1,0]``, the ``linear_*`` sizes), Qwen3's full attention (``--qk-layernorm``,
GQA, ``head_dim``) with a sigmoid output gate (``--attention-output-gate``) and partial rotary
(``--rotary-percent`` = ``partial_rotary_factor``), zero-centred RMSNorms (``--apply-layernorm-1p``; not the
Gated DeltaNet's own output norm, which starts at 1), an untied output layer, and a Qwen2-MoE-style mixture
of experts with a sigmoid-gated shared expert (``--moe-shared-expert-gate``), dense MLPs where
``mlp_only_layers``/``decoder_sparse_step`` say.

Tensors. Full attention: HF's ``q_proj`` holds per head its query rows then its gate rows ``[a, 2, d, h]``;
ptdp keeps the queries in the fused QKV (Llama's layout) and the gates in ``attention.gate``. Gated DeltaNet:
``in_proj_qkvz``/``in_proj_ba``, ``A_log``, ``dt_bias``, ``norm`` and ``out_proj`` as they are (renamed:
``attention.decay.A_log``, ``attention.out_layernorm``); ``conv1d.weight [C, 1, taps]`` lists all q channels,
then all k, then all v, which ptdp regroups per key head (q, k, v of head 0, then of head 1, ...: the layout a
tensor-parallel split cuts in one slice, ``ptdp.models.gated_deltanet``). Experts: either HF layout is read
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
    import torch

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


def _conv_permutation(cfg: ModelConfig) -> torch.Tensor:
    """ptdp's convolution channel c is HF's channel ``perm[c]`` (per key head: its q, k, v channels)."""
    import torch

    nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    vs = cfg.linear_num_value_heads // nk * cfg.linear_value_head_dim
    key = nk * dk
    return torch.cat([torch.cat([torch.arange(j * dk, (j + 1) * dk), key + torch.arange(j * dk, (j + 1) * dk),
                                 2 * key + torch.arange(j * vs, (j + 1) * vs)]) for j in range(nk)])


def read_qwen3_next(hf_config: dict, hf: dict[str, torch.Tensor]) -> tuple[ModelConfig, MoEConfig, dict]:
    import torch

    cfg, moe = _config(hf_config)

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise Qwen3NextConversionError(f"--in: the checkpoint has no tensor {name}; is it a Qwen3-Next model?")
        return hf[name]

    head = take("lm_head.weight")
    padded = cfg.padded_vocab_size(head.shape[0], 1)
    out = {llama.EMBEDDING: take(P + "embed_tokens.weight"), "final_layernorm.weight": take(P + "norm.weight"),
           llama.LM_HEAD: torch.cat([head, head.new_zeros(padded - head.shape[0], head.shape[1])])}
    a, d, h = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
    for i, linear in enumerate(linear_attention_layers(cfg)):
        ours, theirs = f"layers.{i}.", f"{P}layers.{i}."
        names = {**_NORMS, **(_LINEAR if linear else _FULL)}
        out.update({ours + k: take(theirs + v) for k, v in names.items()})
        if linear:
            conv = take(theirs + "linear_attn.conv1d.weight")
            out[ours + "attention.conv1d.weight"] = conv[:, 0][_conv_permutation(cfg)]
        else:
            q_gate = take(theirs + "self_attn.q_proj.weight").view(a, 2, d, h)
            out[ours + "attention.qkv.weight"] = llama._fuse_qkv(
                q_gate[:, 0].reshape(a * d, h), take(theirs + "self_attn.k_proj.weight"),
                take(theirs + "self_attn.v_proj.weight"), cfg)
            out[ours + "attention.gate.weight"] = q_gate[:, 1].reshape(a * d, h)
    out.update(_mlp_from_hf(hf, cfg, moe, take))
    return cfg, moe, {k: v.to(torch.float32).contiguous() for k, v in out.items()}


def _mlp_from_hf(hf: dict, cfg: ModelConfig, moe: MoEConfig, take) -> dict[str, torch.Tensor]:
    import torch

    from ptdp.models.hf_recipe import materialize

    out = {}
    for i, sparse in enumerate(mixtral._pattern(moe, cfg.num_layers)):
        ours, theirs = f"layers.{i}.mlp.", f"{P}layers.{i}.mlp."
        if not sparse:
            out[ours + "fc1.weight"] = torch.stack([take(theirs + "gate_proj.weight"), take(theirs + "up_proj.weight")])
            out[ours + "fc2.weight"] = take(theirs + "down_proj.weight")
            continue
        out[ours + "router.weight"] = take(theirs + "gate.weight")
        layer = f"{P}layers.{i}."
        experts = mixtral.per_expert_layout({n: v for n, v in hf.items() if n.startswith(theirs + "experts.")},
                                            [layer], "qwen3_next")  # the fused (transformers 5) or per-expert layout
        count = sum(1 for n in experts if n.endswith(".gate_proj.weight"))
        if not count:
            raise Qwen3NextConversionError(f"--in: the checkpoint has no experts under {theirs}experts")
        recipes = mixtral.expert_recipes(f"layers.{i}.", layer, count, "qwen3_next")
        stacked = materialize(recipes, experts)
        out[ours + "experts.fc1_weight"] = stacked[ours + "experts.fc1_weight"]
        out[ours + "experts.fc2_weight"] = stacked[ours + "experts.fc2_weight"]
        shared = theirs + "shared_expert."
        out[ours + "shared_expert.fc1.weight"] = torch.stack([take(shared + "gate_proj.weight"),
                                                              take(shared + "up_proj.weight")])
        out[ours + "shared_expert.fc2.weight"] = take(shared + "down_proj.weight")
        out[ours + "shared_expert_gate.weight"] = take(theirs + "shared_expert_gate.weight")
    return out


def write_qwen3_next(tensors: dict[str, torch.Tensor], cfg: ModelConfig, moe: MoEConfig) -> dict[str, torch.Tensor]:
    import torch

    vocab = cfg.vocab_size
    out = {P + "embed_tokens.weight": tensors[llama.EMBEDDING][:vocab], P + "norm.weight": tensors["final_layernorm.weight"],
           "lm_head.weight": tensors[llama.LM_HEAD][:vocab]}
    a, d, h = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
    for i, linear in enumerate(linear_attention_layers(cfg)):
        ours, theirs = f"layers.{i}.", f"{P}layers.{i}."
        names = {**_NORMS, **(_LINEAR if linear else _FULL)}
        out.update({theirs + v: tensors[ours + k] for k, v in names.items()})
        if linear:
            conv = tensors[ours + "attention.conv1d.weight"]
            out[theirs + "linear_attn.conv1d.weight"] = conv[torch.argsort(_conv_permutation(cfg))][:, None]
        else:
            q, k, v = llama._split_qkv(tensors[ours + "attention.qkv.weight"], cfg)
            gate = tensors[ours + "attention.gate.weight"]
            out[theirs + "self_attn.q_proj.weight"] = torch.stack([q.view(a, d, h), gate.view(a, d, h)], 1).reshape(-1, h)
            out.update({theirs + "self_attn.k_proj.weight": k, theirs + "self_attn.v_proj.weight": v})
        mlp = f"{theirs}mlp."
        if f"{ours}mlp.fc1.weight" in tensors:
            gate_w, up = tensors[f"{ours}mlp.fc1.weight"]
            out.update({mlp + "gate_proj.weight": gate_w, mlp + "up_proj.weight": up,
                        mlp + "down_proj.weight": tensors[f"{ours}mlp.fc2.weight"]})
            continue
        out[mlp + "gate.weight"] = tensors[f"{ours}mlp.router.weight"]
        fc1, fc2 = tensors[f"{ours}mlp.experts.fc1_weight"], tensors[f"{ours}mlp.experts.fc2_weight"]
        for e in range(fc1.shape[0]):
            out.update({f"{mlp}experts.{e}.gate_proj.weight": fc1[e, 0], f"{mlp}experts.{e}.up_proj.weight": fc1[e, 1],
                        f"{mlp}experts.{e}.down_proj.weight": fc2[e]})
        gate_w, up = tensors[f"{ours}mlp.shared_expert.fc1.weight"]
        out.update({mlp + "shared_expert.gate_proj.weight": gate_w, mlp + "shared_expert.up_proj.weight": up,
                    mlp + "shared_expert.down_proj.weight": tensors[f"{ours}mlp.shared_expert.fc2.weight"],
                    mlp + "shared_expert_gate.weight": tensors[f"{ours}mlp.shared_expert_gate.weight"]})
    return {k: v.detach().to(torch.float32).contiguous() for k, v in out.items()}


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
