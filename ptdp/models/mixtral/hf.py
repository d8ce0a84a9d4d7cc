"""Hugging Face ``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM`` export and import (``ptdp export/import
--format hf``, through the family registry for ``model_type`` "mixtral" and "qwen2_moe"; Qwen3-MoE reads
and writes its experts here too).

Both are the Llama architecture (``ptdp.models.llama.hf`` converts the shared parts) with a mixture of
experts in place of the MLP (``ptdp.models.moe``):

- router: HF's ``mlp.gate.weight`` (``block_sparse_moe.gate`` in Mixtral's files) ``[E, h]`` is
  ``mlp.router.weight``. Mixtral takes softmax, top-k, renormalise = ptdp's default router; Qwen2-MoE
  renormalises only with ``norm_topk_prob``, else it is ``--moe-router-pre-softmax``.
- experts, two layouts on the HF side, both read: per expert (the files of the published checkpoints and
  of transformers 4: Mixtral ``experts.{i}.w1`` gate, ``w3`` up, ``w2`` down; Qwen2-MoE
  ``experts.{i}.gate_proj/up_proj/down_proj``) or fused (transformers 5's modules: ``experts.gate_up_proj
  [E, 2f, h]``, gate rows first, and ``experts.down_proj [E, h, f]``). ptdp stacks them as
  ``experts.fc1_weight [E, 2, f, h]`` (gate, up) and ``experts.fc2_weight [E, h, f]``. Export writes the
  per-expert layout, which transformers 4 and 5 both load.
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


def _experts_from_hf(hf: dict, layer: str, kind: str, take) -> tuple[torch.Tensor, torch.Tensor]:
    """(fc1 [E, 2, f, h], fc2 [E, h, f]) from the fused (transformers 5) or per-expert layout."""
    import torch

    block = f"{layer}block_sparse_moe." if f"{layer}block_sparse_moe.gate.weight" in hf else f"{layer}mlp."
    if block + "experts.gate_up_proj" in hf:
        gate_up = hf[block + "experts.gate_up_proj"]
        return gate_up.view(gate_up.shape[0], 2, -1, gate_up.shape[-1]), take(block + "experts.down_proj")
    names = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    fc1, fc2, i = [], [], 0
    while f"{block}experts.{i}.{names[0]}.weight" in hf:
        gate, up, down = (take(f"{block}experts.{i}.{n}.weight") for n in names)
        fc1.append(torch.stack([gate, up]))
        fc2.append(down)
        i += 1
    if not fc1:
        raise MoEConversionError(f"--in: the checkpoint has no experts under {block}experts; is it a {kind} model?")
    return torch.stack(fc1), torch.stack(fc2)


def from_hf_state(hf: dict[str, torch.Tensor], cfg: ModelConfig, moe: MoEConfig, kind: str) -> dict[str, torch.Tensor]:
    """HF Mixtral / Qwen2-MoE tensors (either expert layout) -> ptdp full tensors."""
    import torch

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise MoEConversionError(f"--in: the checkpoint has no tensor {name}; is it a {kind} model?")
        return hf[name]

    dense = {k: v for k, v in hf.items() if ".experts." not in k and ".block_sparse_moe." not in k
             and ".mlp.gate.weight" not in k and ".mlp.shared_expert" not in k}
    out = {}
    pattern = _pattern(moe, cfg.num_layers)
    for i, sparse in enumerate(pattern):
        theirs, ours = f"{P}layers.{i}.", f"layers.{i}."
        if not sparse:
            continue
        for x in ("gate", "up", "down"):  # absent here: dense tensors only for the Llama converter
            dense[f"{theirs}mlp.{x}_proj.weight"] = torch.empty(0)
        router = f"{theirs}block_sparse_moe.gate.weight" if f"{theirs}block_sparse_moe.gate.weight" in hf \
            else f"{theirs}mlp.gate.weight"
        out[ours + "mlp.router.weight"] = take(router)
        out[ours + "mlp.experts.fc1_weight"], out[ours + "mlp.experts.fc2_weight"] = _experts_from_hf(
            hf, theirs, kind, take)
        if kind == "qwen2_moe":
            shared = f"{theirs}mlp.shared_expert."
            out[ours + "mlp.shared_expert.fc1.weight"] = torch.stack([take(shared + "gate_proj.weight"),
                                                                      take(shared + "up_proj.weight")])
            out[ours + "mlp.shared_expert.fc2.weight"] = take(shared + "down_proj.weight")
            out[ours + "mlp.shared_expert_gate.weight"] = take(f"{theirs}mlp.shared_expert_gate.weight")
    llama = hf_llama.from_hf_state(dense, cfg)
    for i, sparse in enumerate(pattern):
        if sparse:
            del llama[f"layers.{i}.mlp.fc1.weight"], llama[f"layers.{i}.mlp.fc2.weight"]
    if cfg.add_qkv_bias:
        for i in range(cfg.num_layers):
            biases = [take(f"{P}layers.{i}.self_attn.{x}_proj.bias") for x in "qkv"]
            llama[f"layers.{i}.attention.qkv.bias"] = _fuse_qkv_bias(biases, cfg)
    out = {**llama, **out}
    return {k: v.to(torch.float32).contiguous() for k, v in out.items()}


def _bias_cfg(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, hidden_size=1, kv_channels=cfg.head_dim)  # a bias is a weight with h = 1


def _fuse_qkv_bias(biases: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    return hf_llama._fuse_qkv(*(b.unsqueeze(-1) for b in biases), _bias_cfg(cfg)).squeeze(-1)


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
