"""Megatron-Core's parameter names and layouts to and from ptdp's full (t = 1) tensors.

The intermediate form both checkpoint formats meet in: full tensors (no tensor-parallel split) under
Megatron-Core's per-layer names with global layer numbers, ``decoder.layers.<i>.self_attention.linear_qkv.weight``.
The norms go by Transformer Engine's names (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``),
which ``torch_dist`` checkpoints use for the local layers too; the local names (``input_layernorm``,
``pre_mlp_layernorm``) of a ``torch`` checkpoint are renamed to them (:func:`canonical`).

Layouts that differ from ptdp's:

- QKV: Megatron interleaves per query group ``[q of its a/G heads, k, v]`` (G = a without GQA). ptdp's GQA
  layout is the same; without GQA ptdp holds ``[3, a·d, h]`` (all q, all k, all v).
- SwiGLU: Megatron's ``linear_fc1`` is ``[gate; up]`` (``[2·ffn, h]``), ptdp's ``fc1`` ``[2, ffn, h]``.
- Experts: Megatron's per-expert ``local_experts.<e>.linear_fc1`` (or the grouped GEMM's ``weight<e>``) are
  ptdp's stacked ``experts.fc1_weight`` ``[E, (2,) ffn, h]``.
- Tied models: Megatron keeps a copy of the embedding as ``output_layer.weight`` on the last pipeline stage;
  ptdp reads the embedding and writes both.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ptdp.config import ModelConfig, MoEConfig
from ptdp.megatron.args import MegatronError

if TYPE_CHECKING:
    import torch

EMBEDDING = "embedding.word_embeddings.weight"
POSITIONS = "embedding.position_embeddings.weight"
OUTPUT = "output_layer.weight"
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# local-spec name -> the Transformer Engine name a torch_dist checkpoint uses for it
_LOCAL_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
                "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
                "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias"}

# Megatron suffix inside a layer -> ptdp suffix inside layers.<i> (same shapes)
_PLAIN = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
          "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
          "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
          "mlp.linear_fc1.layer_norm_bias": "post_attention_layernorm.bias",
          "self_attention.linear_proj.weight": "attention.proj.weight",
          "self_attention.linear_proj.bias": "attention.proj.bias",
          "self_attention.q_layernorm.weight": "attention.q_layernorm.weight",
          "self_attention.k_layernorm.weight": "attention.k_layernorm.weight",
          "mlp.linear_fc2.weight": "mlp.fc2.weight",
          "mlp.linear_fc2.bias": "mlp.fc2.bias",
          "mlp.router.weight": "mlp.router.weight",
          "mlp.router.expert_bias": "mlp.router.expert_bias"}
_GLOBAL = {EMBEDDING: EMBEDDING, POSITIONS: POSITIONS, "decoder.final_layernorm.weight": "final_layernorm.weight",
           "decoder.final_layernorm.bias": "final_layernorm.bias"}
# Megatron's tensor-parallel split dimension of each parameter (by the end of its name); others are replicated
_COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias", "word_embeddings.weight",
           "output_layer.weight")
_ROW = ("linear_proj.weight", "linear_fc2.weight")
_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.linear_(fc[12])\.weight|linear_(fc[12])\.weight(\d+))$")


def canonical(name: str) -> str:
    """``name`` with the local layers' norm names replaced by Transformer Engine's."""
    match = LAYER.match(name)
    if match and match.group(2) in _LOCAL_NORMS:
        return f"decoder.layers.{match.group(1)}.{_LOCAL_NORMS[match.group(2)]}"
    return name


def _qkv_to_ptdp(qkv: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    if cfg.group_query_attention:
        return qkv
    a, d = cfg.num_attention_heads, cfg.head_dim
    return qkv.reshape(a, 3, d, *qkv.shape[1:]).transpose(0, 1).reshape(3, a * d, *qkv.shape[1:])


def _qkv_to_megatron(qkv: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    if cfg.group_query_attention:
        return qkv
    a, d = cfg.num_attention_heads, cfg.head_dim
    return qkv.reshape(3, a, d, *qkv.shape[2:]).transpose(0, 1).reshape(3 * a * d, *qkv.shape[2:])


def to_ptdp(tensors: dict[str, torch.Tensor], cfg: ModelConfig, moe: MoEConfig) -> dict[str, torch.Tensor]:
    """Megatron full tensors (per-layer names, :func:`canonical`) -> ptdp's; a name neither maps is refused."""
    import torch

    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, value in tensors.items():
        name = canonical(name)
        if name in _GLOBAL:
            out[_GLOBAL[name]] = value
            continue
        if name == OUTPUT:
            if cfg.untie_embeddings_and_output_weights:
                out["lm_head.weight"] = value
            continue  # the tied embedding's copy
        match = LAYER.match(name)
        if match is None:
            raise MegatronError(f"--in: the checkpoint holds {name}, which ptdp's GPT model has no place for")
        i, suffix = int(match.group(1)), match.group(2)
        ours = f"layers.{i}."
        if suffix in _PLAIN:
            out[ours + _PLAIN[suffix]] = value
        elif suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            out[ours + "attention.qkv." + suffix.rsplit(".", 1)[1]] = _qkv_to_ptdp(value, cfg)
        elif suffix in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"):
            out[ours + "mlp.fc1." + suffix.rsplit(".", 1)[1]] = (
                value.reshape(2, value.shape[0] // 2, *value.shape[1:]) if cfg.swiglu else value)
        elif suffix.startswith("mlp.shared_experts."):
            rest = suffix.removeprefix("mlp.shared_experts.")
            if rest == "linear_fc1.weight" and cfg.swiglu:
                value = value.reshape(2, value.shape[0] // 2, value.shape[1])
            key = {"linear_fc1.weight": "shared_expert.fc1.weight", "linear_fc2.weight": "shared_expert.fc2.weight",
                   "gate_weight": "shared_expert_gate.weight"}
            if rest not in key:
                raise MegatronError(f"--in: the checkpoint holds {name}, which ptdp's shared expert has no place for")
            out[ours + "mlp." + key[rest]] = value
        elif (expert := _EXPERT.match(suffix)) is not None:
            e, fc = (int(expert.group(1)), expert.group(2)) if expert.group(1) else (int(expert.group(4)), expert.group(3))
            experts.setdefault((i, fc), {})[e] = value
        else:
            raise MegatronError(f"--in: the checkpoint holds {name}, which ptdp's GPT model has no place for")
    for (i, fc), per_expert in experts.items():
        stacked = torch.stack([per_expert[e] for e in sorted(per_expert)])
        if fc == "fc1" and cfg.swiglu:
            stacked = stacked.reshape(stacked.shape[0], 2, stacked.shape[1] // 2, stacked.shape[2])
        out[f"layers.{i}.mlp.experts.{fc}_weight"] = stacked
    return out


def to_megatron(tensors: dict[str, torch.Tensor], cfg: ModelConfig, moe: MoEConfig) -> dict[str, torch.Tensor]:
    """ptdp's full tensors -> Megatron-Core's (per-layer names, local experts; the inverse of :func:`to_ptdp`)."""
    back = {v: k for k, v in _PLAIN.items()}
    back_global = {v: k for k, v in _GLOBAL.items()}
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        if name in back_global:
            out[back_global[name]] = value
            continue
        if name == "lm_head.weight":
            out[OUTPUT] = value
            continue
        i, suffix = name.removeprefix("layers.").split(".", 1)
        theirs = f"decoder.layers.{i}."
        if suffix in back:
            out[theirs + back[suffix]] = value
        elif suffix.startswith("attention.qkv."):
            out[theirs + "self_attention.linear_qkv." + suffix.rsplit(".", 1)[1]] = _qkv_to_megatron(value, cfg)
        elif suffix.startswith("mlp.fc1."):
            out[theirs + "mlp.linear_fc1." + suffix.rsplit(".", 1)[1]] = (
                value.reshape(-1, *value.shape[2:]) if cfg.swiglu else value)
        elif suffix.startswith(("mlp.shared_expert.", "mlp.shared_expert_gate.")):
            key = {"mlp.shared_expert.fc1.weight": "linear_fc1.weight", "mlp.shared_expert.fc2.weight": "linear_fc2.weight",
                   "mlp.shared_expert_gate.weight": "gate_weight"}
            fused = suffix == "mlp.shared_expert.fc1.weight"
            out[theirs + "mlp.shared_experts." + key[suffix]] = value.reshape(-1, value.shape[-1]) if fused else value
        elif suffix in ("mlp.experts.fc1_weight", "mlp.experts.fc2_weight"):
            fc = suffix.removeprefix("mlp.experts.")[:3]
            for e in range(value.shape[0]):
                expert = value[e].reshape(-1, value.shape[-1]) if fc == "fc1" else value[e]
                out[f"{theirs}mlp.experts.local_experts.{e}.linear_{fc}.weight"] = expert
        else:
            raise MegatronError(f"--load: ptdp's {name} has no Megatron-Core equivalent in this export")
    if OUTPUT not in out and cfg.untie_embeddings_and_output_weights is False:
        out[OUTPUT] = out[EMBEDDING]  # the last pipeline stage's copy of the tied embedding
    return out


def split_dim(name: str) -> int | None:
    """The dimension Megatron's tensor parallelism splits parameter ``name`` along (None: replicated)."""
    if name.endswith(("norm_weight", "norm_bias")) or not name.endswith(_COLUMN + _ROW):
        return None
    return 1 if name.endswith(_ROW) else 0


def join_slices(name: str, parts: list, swiglu: bool) -> torch.Tensor:
    """One parameter from its tensor-parallel slices (in rank order)."""
    import torch

    if len(parts) == 1 or split_dim(name) is None:
        return parts[0]
    if split_dim(name) == 1:
        return torch.cat(parts, dim=1)
    if swiglu and "linear_fc1" in name:  # each rank holds [gate_r; up_r]: gates first, then ups
        halves = [part.chunk(2, dim=0) for part in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=0)
