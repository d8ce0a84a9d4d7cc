"""Hugging Face ``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM`` export and import (``ptdp export/import
--format hf``, through the family registry for ``model_type`` "mixtral" and "qwen2_moe"; Qwen3-MoE reads
and writes its experts here too).

Both are the Llama architecture (``ptdp.models.llama.hf`` converts the shared parts) with a mixture of
experts in place of the MLP (``ptdp.models.moe``):

- router: HF's ``mlp.gate.weight`` (``block_sparse_moe.gate`` in Mixtral's files) ``[E, h]`` is
  ``mlp.router.weight``. Mixtral takes softmax, top-k, renormalise = ptdp's default router; Qwen2-MoE
  renormalises only with ``norm_topk_prob``, else it is ``--moe-router-pre-softmax``.
- experts, two layouts on the HF side, both read (by import and by ``--load HF_DIR``, a rank reading only
  its experts' rows): per expert (the files of the published checkpoints, and what transformers 4 and 5's
  ``save_pretrained`` write: Mixtral ``block_sparse_moe.experts.{i}.w1`` gate, ``w3`` up, ``w2`` down;
  Qwen2-MoE ``mlp.experts.{i}.gate_proj/up_proj/down_proj``) or fused (transformers 5's modules, which
  ``save_pretrained(..., save_original_format=False)`` writes: ``mlp.experts.gate_up_proj [E, 2f, h]``, gate
  rows first, and ``mlp.experts.down_proj [E, h, f]``; a Mixtral's router then under ``mlp.gate``). ptdp
  stacks them as ``experts.fc1_weight [E, 2, f, h]`` (gate, up) and ``experts.fc2_weight [E, h, f]``.
  Export writes the per-expert layout, which transformers 4 and 5 both load.
- Qwen2-MoE only: a shared expert (``mlp.shared_expert.{gate,up,down}_proj``, hidden size
  ``shared_expert_intermediate_size``) with a sigmoid gate ``mlp.shared_expert_gate [1, h]``
  (``--moe-shared-expert-intermediate-size``, ``--moe-shared-expert-gate``); a QKV bias
  (``--add-qkv-bias``); dense layers where ``decoder_sparse_step``/``mlp_only_layers`` say (a
  ``--moe-layer-freq`` list).

HF computes every expert's tokens (dropless); a ``--moe-expert-capacity-factor`` is a training setting and is
not exported. Auxiliary-loss coefficients are not part of the model either.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ptdp.config import ConfigError, ModelConfig, MoEConfig
from ptdp.models.llama import hf as hf_llama

if TYPE_CHECKING:
    import torch

P = hf_llama.HF_PREFIX


class MoEConversionError(ConfigError):
    """Something in the model or its files that ptdp's mixture of experts cannot represent; one line."""


def _pattern(moe: MoEConfig, num_layers: int) -> list[bool]:
    from ptdp.models.moe import moe_layer_pattern

    return moe_layer_pattern(moe.moe_layer_freq, num_layers) if moe.num_experts else [False] * num_layers


def hf_kind(cfg: ModelConfig, moe: MoEConfig) -> str | None:
    """"mixtral", "qwen2_moe" or None: which HF class computes exactly what this ptdp model does."""
    if not moe.num_experts or not hf_llama.is_llama(dataclasses.replace(cfg, add_qkv_bias=False)):
        return None
    if all(_pattern(moe, cfg.num_layers)) and not moe.moe_shared_expert_intermediate_size \
            and not moe.moe_router_pre_softmax and not cfg.add_qkv_bias:
        return "mixtral"
    if moe.moe_shared_expert_intermediate_size and moe.moe_shared_expert_gate:
        return "qwen2_moe"
    return None


def _layout(kind: str) -> tuple[str, tuple[str, str, str]]:
    """(the block, the (gate, up, down) names) of the per-expert layout ``save_pretrained`` writes."""
    if kind == "mixtral":
        return "block_sparse_moe", ("w1", "w3", "w2")
    return "mlp", ("gate_proj", "up_proj", "down_proj")


def moe_recipes(cfg: ModelConfig, moe: MoEConfig, padded_vocab: int, kind: str) -> dict:
    """Per ptdp parameter, its recipe (``ptdp.models.hf_recipe``) over HF tensors in the per-expert layout:
    Llama's, the QKV bias cut like the QKV weight, and in each sparse layer the router, the experts stacked
    as ``fc1_weight [E, 2, f, h]`` (gate, up) and ``fc2_weight [E, h, f]``, and Qwen2-MoE's gated shared
    expert. Import, ``--load HF_DIR`` and export all run this one mapping."""
    from ptdp.models.hf_recipe import OneOf, Stack, Take

    out = hf_llama.hf_recipes(cfg, padded_vocab)
    block, (gate, up, down) = _layout(kind)
    for i, sparse in enumerate(_pattern(moe, cfg.num_layers)):
        ours, theirs = f"layers.{i}.", f"{P}layers.{i}."
        if cfg.add_qkv_bias:
            out[ours + "attention.qkv.bias"] = hf_llama.qkv_recipe(cfg, theirs, "bias")
        if not sparse:
            continue
        del out[ours + "mlp.fc1.weight"], out[ours + "mlp.fc2.weight"]
        router = Take(f"{theirs}{block}.gate.weight")  # a fused Mixtral's is under mlp., as its experts
        out[ours + "mlp.router.weight"] = router if block == "mlp" else OneOf((router, Take(f"{theirs}mlp.gate.weight")))
        out.update(expert_recipes(ours, theirs, moe.num_experts, kind))
        if kind == "qwen2_moe":
            shared = f"{theirs}mlp.shared_expert."
            out[ours + "mlp.shared_expert.fc1.weight"] = Stack((Take(shared + "gate_proj.weight"),
                                                                Take(shared + "up_proj.weight")))
            out[ours + "mlp.shared_expert.fc2.weight"] = Take(shared + "down_proj.weight")
            out[ours + "mlp.shared_expert_gate.weight"] = Take(f"{theirs}mlp.shared_expert_gate.weight")
    return out


def expert_recipes(ours: str, theirs: str, num_experts: int, kind: str) -> dict:
    """The recipes of one layer's experts (ptdp layer ``ours``, HF layer ``theirs``), from whichever layout
    the checkpoint holds (per expert first, which export writes): ``fc1_weight [E, 2, f, h]`` stacks each
    expert's (gate, up) or views the fused ``gate_up_proj [E, 2f, h]`` as its two row blocks;
    ``fc2_weight [E, h, f]`` stacks each expert's down or is the fused ``down_proj``. Either way a box of
    experts ``[a, b)`` and rows ``[c, d)`` reads those experts' rows alone."""
    from ptdp.models.hf_recipe import OneOf, Stack, Take, Unflatten

    block, (gate, up, down) = _layout(kind)
    experts = [f"{theirs}{block}.experts.{e}." for e in range(num_experts)]
    fused = f"{theirs}mlp.experts."
    return {ours + "mlp.experts.fc1_weight": OneOf((
                Stack(tuple(Stack((Take(f"{x}{gate}.weight"), Take(f"{x}{up}.weight"))) for x in experts)),
                Unflatten(Take(fused + "gate_up_proj"), 2, dim=1))),
            ours + "mlp.experts.fc2_weight": OneOf((Stack(tuple(Take(f"{x}{down}.weight") for x in experts)),
                                                    Take(fused + "down_proj")))}


def from_hf_state(hf: dict[str, torch.Tensor], cfg: ModelConfig, moe: MoEConfig, kind: str) -> dict[str, torch.Tensor]:
    """HF Mixtral / Qwen2-MoE tensors (either expert layout) -> ptdp full tensors: :func:`moe_recipes`
    evaluated whole."""
    return hf_llama.import_state(lambda padded: moe_recipes(cfg, moe, padded, kind), hf, cfg,
                                 lambda e: MoEConversionError(f"--in: {e}; is it a {kind} model?"))


def _bias_cfg(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, hidden_size=1, kv_channels=cfg.head_dim)  # a bias is a weight with h = 1


def to_hf_state(tensors: dict[str, torch.Tensor], cfg: ModelConfig, moe: MoEConfig, kind: str) -> dict[str, torch.Tensor]:
    """ptdp full tensors -> HF tensors in the per-expert layout (Mixtral's ``block_sparse_moe`` names)."""
    import torch

    pattern = _pattern(moe, cfg.num_layers)
    dense = dict(tensors)
    h = cfg.hidden_size
    for i, sparse in enumerate(pattern):
        if sparse:  # placeholders for the Llama converter's MLP (dropped below)
            dense[f"layers.{i}.mlp.fc1.weight"] = torch.zeros(2, 1, h)
            dense[f"layers.{i}.mlp.fc2.weight"] = torch.zeros(h, 1)
    out = hf_llama.to_hf_state(dense, cfg)
    block = "block_sparse_moe" if kind == "mixtral" else "mlp"
    names = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for i, sparse in enumerate(pattern):
        ours, theirs = f"layers.{i}.", f"{P}layers.{i}."
        if cfg.add_qkv_bias:
            q, k, v = hf_llama._split_qkv(tensors[ours + "attention.qkv.bias"].unsqueeze(-1), _bias_cfg(cfg))
            out.update({f"{theirs}self_attn.{x}_proj.bias": b.reshape(-1) for x, b in zip("qkv", (q, k, v))})
        if not sparse:
            continue
        for x in ("gate", "up", "down"):
            del out[f"{theirs}mlp.{x}_proj.weight"]
        out[f"{theirs}{block}.gate.weight"] = tensors[ours + "mlp.router.weight"]
        fc1, fc2 = tensors[ours + "mlp.experts.fc1_weight"], tensors[ours + "mlp.experts.fc2_weight"]
        for e in range(fc1.shape[0]):
            expert = f"{theirs}{block}.experts.{e}."
            out.update({expert + f"{names[0]}.weight": fc1[e, 0], expert + f"{names[1]}.weight": fc1[e, 1],
                        expert + f"{names[2]}.weight": fc2[e]})
        if kind == "qwen2_moe":
            shared = f"{theirs}mlp.shared_expert."
            gate, up = tensors[ours + "mlp.shared_expert.fc1.weight"]
            out.update({shared + "gate_proj.weight": gate, shared + "up_proj.weight": up,
                        shared + "down_proj.weight": tensors[ours + "mlp.shared_expert.fc2.weight"],
                        f"{theirs}mlp.shared_expert_gate.weight": tensors[ours + "mlp.shared_expert_gate.weight"]})
    return {k: v.detach().to(torch.float32).contiguous() for k, v in out.items()}


def model_config_from_hf(hf_config: dict) -> tuple[ModelConfig, MoEConfig, str]:
    """ptdp's model and MoE flags for an HF Mixtral or Qwen2-MoE ``config.json``."""
    kind = hf_config.get("model_type")
    base = dict(hf_config)
    if kind == "qwen2_moe" and not base.get("use_sliding_window"):
        base.pop("sliding_window", None)  # set but unused without use_sliding_window
    if float(base.get("router_jitter_noise") or 0.0):
        raise MoEConversionError("--in: config.json has router_jitter_noise > 0; ptdp's router adds no noise")
    cfg = hf_llama.model_config_from_hf(base)
    n = hf_config["num_hidden_layers"]
    if kind == "mixtral":
        moe = MoEConfig(num_experts=hf_config["num_local_experts"], moe_router_topk=hf_config["num_experts_per_tok"],
                        moe_ffn_hidden_size=hf_config["intermediate_size"])
        return cfg, moe, kind
    step, dense_only = hf_config.get("decoder_sparse_step", 1), set(hf_config.get("mlp_only_layers") or [])
    pattern = [int(i not in dense_only and (i + 1) % step == 0) for i in range(n)]
    moe = MoEConfig(num_experts=hf_config["num_experts"], moe_router_topk=hf_config["num_experts_per_tok"],
                    moe_ffn_hidden_size=hf_config["moe_intermediate_size"],
                    moe_layer_freq="1" if all(pattern) else str(pattern).replace(" ", ""),
                    moe_shared_expert_intermediate_size=hf_config["shared_expert_intermediate_size"],
                    moe_shared_expert_gate=True, moe_router_pre_softmax=not hf_config.get("norm_topk_prob", False))
    return dataclasses.replace(cfg, add_qkv_bias=bool(hf_config.get("qkv_bias", True))), moe, kind


def hf_config_kwargs(cfg: ModelConfig, moe: MoEConfig, kind: str, bos: int | None, eos: int | None) -> dict[str, Any]:
    """``MixtralConfig`` / ``Qwen2MoeConfig`` keyword arguments that make HF compute what ptdp computes."""
    llama = hf_llama.hf_config_kwargs(dataclasses.replace(cfg, add_qkv_bias=False), bos, eos)
    for key in ("attention_bias", "mlp_bias"):
        llama.pop(key)
    ffn = moe.moe_ffn_hidden_size or cfg.ffn_size
    if kind == "mixtral":
        return {**llama, "intermediate_size": ffn, "num_local_experts": moe.num_experts,
                "num_experts_per_tok": moe.moe_router_topk, "router_jitter_noise": 0.0, "sliding_window": None,
                "architectures": ["MixtralForCausalLM"]}
    pattern = _pattern(moe, cfg.num_layers)
    return {**llama, "num_experts": moe.num_experts, "num_experts_per_tok": moe.moe_router_topk,
            "moe_intermediate_size": ffn, "shared_expert_intermediate_size": moe.moe_shared_expert_intermediate_size,
            "norm_topk_prob": not moe.moe_router_pre_softmax, "qkv_bias": cfg.add_qkv_bias, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, sparse in enumerate(pattern) if not sparse], "use_sliding_window": False,
            "architectures": ["Qwen2MoeForCausalLM"]}
