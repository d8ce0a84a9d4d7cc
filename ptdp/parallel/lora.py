"""LoRA (docs/references.md, §LoRA): the base weights frozen, a low-rank adapter beside each targeted linear.

An adapter adds ``(alpha/r) · B A x`` to its linear's output, ``A`` ``[r, in]`` and ``B`` ``[out, r]`` (a
fused linear's ``B`` is ``[k, out, r]``, one block per fused projection, so that its rows line up with the
weight's). It starts as PEFT starts one -- ``A`` Kaiming-uniform (a = √5), ``B`` zero -- so a fresh adapter
leaves the model unchanged (``ptdp.parallel.init.init_parameter``). Megatron-Bridge's module names choose the
targets: ``linear_qkv`` (``attention.qkv``), ``linear_proj`` (``attention.proj``), ``linear_fc1``
(``mlp.fc1``), ``linear_fc2`` (``mlp.fc2``).

Applied to each chunk after the tensor-parallel split, so an adapter is cut to match its linear:

- a column-parallel linear (QKV, fc1; its rank holds some output rows): ``B`` is split by rows like the
  weight, ``A`` is whole on every rank. ``A x`` is computed on the linear's own input and then enters the
  tensor-parallel region as the linear's input does (``f``, or under sequence parallelism the all-gather of
  the sequence), so its backward sums ``B``'s pieces' contributions over the ranks: ``A``'s gradient is then
  whole, except under sequence parallelism, where each rank saw its own tokens (``partial_over`` TP, summed
  after the backward as the norms' are);
- a row-parallel linear (attention output, fc2; its rank holds some input columns): ``A`` is split by
  columns like the weight, ``B`` is whole. ``B A_k x_k`` is added to the rank's partial product *before* the
  linear's reduction, which sums it with the rest (B is linear); ``B``'s gradient on each rank is then the
  part of its rank's ``A_k x_k``: ``partial_over`` TP.

Megatron-Bridge keeps ``A`` of a column-parallel base split by its rank dimension (and ``B`` of a row-parallel
base split by rows, its output gathered); the adapters are so small (r·(in + out) per linear) that ptdp keeps
those whole instead, which spares a gather forward and an all-reduce backward per adapter. Checkpoints and
exports hold the full ``A`` and ``B`` whatever the layout.

A MoE layer's stacked experts get stacked adapters (``linear_fc1``/``linear_fc2``, as Megatron-Bridge's
targets): one ``A``/``B`` per expert, through the experts' grouped GEMMs, split by experts (role ``expert``:
reduced over the expert-data-parallel group) like the weights.

Everything that is not an adapter is frozen (``requires_grad`` False): the gradient buffers skip it
(``ptdp.parallel.data.buffer``), so it gets no gradient memory, no optimizer state and no reduction (ZeRO-3
still shards it: ``FlatBuffer.frozen_buckets``, gathered, never reduced); its placement records stay, so
initialisation, checkpoints and exports read and write it as before.
"""

from __future__ import annotations

import contextlib
import fnmatch

import torch
from torch import nn

from ptdp.config import LoRAConfig
from ptdp.ops.grouped import grouped_linear
from ptdp.ops.weight_grad import linear
from ptdp.parallel.collectives import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    group_size,
)
from ptdp.parallel.placement import Placement, Placements, Split
from ptdp.parallel.tensor.random import get_rng_tracker

TARGET_MODULES = {  # Megatron-Bridge's name -> the module's name inside a transformer layer
    "linear_qkv": "attention.qkv",
    "linear_proj": "attention.proj",
    "linear_fc1": "mlp.fc1",
    "linear_fc2": "mlp.fc2",
}
ADAPTER = "adapter"  # the adapter's module name inside its linear: ``layers.3.mlp.fc1.adapter.lora_A``


def is_adapter(name: str) -> bool:
    """Whether a full-model parameter name is an adapter's (``...fc1.adapter.lora_A``, the experts'
    ``...experts.fc1_adapter.lora_A``)."""
    return name.endswith((f"{ADAPTER}.lora_A", f"{ADAPTER}.lora_B"))


class LoRAAdapter(nn.Module):
    """``scaling · B (A dropout(x))`` on this rank: ``column`` (the linear splits its outputs: ``A x`` enters
    the tensor-parallel region, ``sequence_parallel`` as a sequence all-gather) or not (the linear splits its
    inputs: the partial product is returned for the linear's reduction)."""

    def __init__(self, a_shape: tuple[int, ...], b_shape: tuple[int, ...], scaling: float, dropout: float,
                 column: bool, tp_group=None, sequence_parallel: bool = False):
        super().__init__()
        self.lora_A = nn.Parameter(torch.empty(a_shape))
        self.lora_B = nn.Parameter(torch.empty(b_shape))
        self.scaling, self.dropout = scaling, dropout
        self.column, self.tp_group, self.sequence_parallel = column, tp_group, sequence_parallel
        # each rank drops its own features or tokens (a row-parallel input, sequence parallelism): its own mask
        self.per_rank_mask = group_size(tp_group) > 1 and (sequence_parallel or not column)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.dropout > 0.0:
            with get_rng_tracker().fork() if self.per_rank_mask else contextlib.nullcontext():
                x = torch.nn.functional.dropout(x, self.dropout)
        z = linear(x, self.lora_A)
        if self.column and self.sequence_parallel:
            z = gather_from_sequence_parallel_region(z, self.tp_group)
        elif self.column:
            z = copy_to_tensor_model_parallel_region(z, self.tp_group)
        return linear(z, self.lora_B) * self.scaling


class ExpertLoRAAdapter(nn.Module):
    """The adapters of E_local stacked experts, ``A [E, r, in]``, ``B [E, (g,) out, r]``: the rows of each
    expert through its own ``scaling · B_e A_e`` (grouped like the experts' weights, ``ptdp.ops.grouped``).
    Expert parallelism slices them by experts, as the weights; each rank holds its experts whole."""

    def __init__(self, a_shape: tuple[int, ...], b_shape: tuple[int, ...], scaling: float, dropout: float,
                 grouped: bool):
        super().__init__()
        self.lora_A = nn.Parameter(torch.empty(a_shape))
        self.lora_B = nn.Parameter(torch.empty(b_shape))
        self.scaling, self.dropout, self.grouped = scaling, dropout, grouped

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if self.training and self.dropout > 0.0:
            x = torch.nn.functional.dropout(x, self.dropout)
        z = grouped_linear(x, self.lora_A, tokens_per_expert, self.grouped)
        return grouped_linear(z, self.lora_B, tokens_per_expert, self.grouped) * self.scaling


def _attach_expert_adapters(experts: nn.Module, lora: LoRAConfig, placements: Placements) -> None:
    """``linear_fc1``/``linear_fc2`` adapt the experts too (Megatron-Bridge's targets): one adapter per expert,
    stacked, split by experts as the weights are (the refusal of expert tensor parallelism is the config's)."""
    r = lora.lora_rank
    for target, name in (("linear_fc1", "fc1"), ("linear_fc2", "fc2")):
        if target not in lora.lora_target_modules:
            continue
        weight = getattr(experts, f"{name}_weight")
        base = placements[weight]
        with torch.device(weight.device):
            adapter = ExpertLoRAAdapter((weight.shape[0], r, weight.shape[-1]), (*weight.shape[:-1], r),
                                        lora.lora_alpha / r, lora.lora_dropout, experts.grouped)
        prefix = base.name.removesuffix("_weight") + f"_{ADAPTER}."
        experts_split = tuple(s for s in base.splits if s.axis == "ep")
        placements.record(adapter.lora_A, Placement(prefix + "lora_A", experts_split, role="expert"))
        placements.record(adapter.lora_B, Placement(prefix + "lora_B", experts_split, role="expert"))
        setattr(experts, f"{name}_adapter", adapter)


def _tp_split(placement: Placement) -> Split | None:
    return next((s for s in placement.splits if s.axis == "tp"), None)


def apply_lora(model: nn.Module, lora: LoRAConfig, placements: Placements, tp_group=None,
               sequence_parallel: bool = False) -> nn.Module:
    """Attach an adapter to each targeted linear of ``model`` (a chunk, after its tensor-parallel split;
    on the meta device) and freeze every other parameter; the adapters' records go into ``placements``
    (full names ``<linear>.adapter.lora_A``/``lora_B``). Returns ``model``."""
    patterns = [f"*layers.*.{TARGET_MODULES[t]}" for t in lora.lora_target_modules]
    targets = [(name, module) for name, module in model.named_modules()
               if any(fnmatch.fnmatchcase(name, p) for p in patterns) and hasattr(module, "adapter")]
    for param in model.parameters():
        param.requires_grad_(False)
    r, t = lora.lora_rank, group_size(tp_group)
    for _, module in targets:
        weight = module.weight
        base = placements[weight]
        split = _tp_split(base)
        column = split is None or split.dim != weight.dim() - 1  # the output rows are split (or nothing is)
        with torch.device(weight.device):
            adapter = LoRAAdapter((r, weight.shape[-1]), (*weight.shape[:-1], r), lora.lora_alpha / r,
                                  lora.lora_dropout, column, tp_group, sequence_parallel)
        prefix = base.name.removesuffix(".weight") + f".{ADAPTER}."
        a_splits = () if column or split is None else (Split("tp", 1, split.size, split.index),)
        b_splits = (Split("tp", adapter.lora_B.dim() - 2, split.size, split.index),) if column and split else ()
        placements.record(adapter.lora_A, Placement(prefix + "lora_A", a_splits))
        placements.record(adapter.lora_B, Placement(prefix + "lora_B", b_splits))
        if t > 1 and ((column and sequence_parallel) or not column):  # each rank's gradient is part of the sum
            placements.add_partial(adapter.lora_A if column else adapter.lora_B, "tp")
        module.adapter = adapter
    for module in model.modules():
        if hasattr(module, "fc1_adapter"):  # a MoE layer's stacked experts
            _attach_expert_adapters(module, lora, placements)
    return model


def merge_lora(tensors: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """Full tensors with the adapters folded in: ``W + scaling · B A`` for each adapted weight (a fused
    ``[k, out, in]`` one block by block), the adapters dropped."""
    out = {name: t for name, t in tensors.items() if not is_adapter(name)}
    for name in tensors:
        for sep, weight_suffix in ((f".{ADAPTER}.lora_A", ".weight"), (f"_{ADAPTER}.lora_A", "_weight")):
            if not name.endswith(sep):
                continue
            stem = name.removesuffix(sep)
            a, b = tensors[name].float(), tensors[name.removesuffix("lora_A") + "lora_B"].float()
            if a.dim() == 3:  # stacked experts [E, r, in]: one A per expert, against B [E, (g,) out, r]
                a = a.view(a.shape[0], *([1] * (b.dim() - 3)), *a.shape[1:])
            weight = out[stem + weight_suffix]
            out[stem + weight_suffix] = (weight.float() + scaling * torch.matmul(b, a)).to(weight.dtype)
    return out
