"""Tensor (and sequence) parallelism applied to a plain model: its blocks swapped for split ones, as the
model's sharding rules say (``ptdp.models.sharding``; ``GPTModel.sharding_rules``). Nothing here names an
attribute of one model class: a rule names a module, and one handler per kind of rule applies it.

Megatron's plan (paper §2.3) is what the rules of the models in ``ptdp.models`` say: in each layer the QKV
and fc1 projections column-parallel (each rank its a/t heads, its ffn/t columns), the attention and fc2
output projections row-parallel (``g`` sums the partial products); the embedding and the output weight
split by vocabulary rows, the logits left split for the vocabulary-parallel cross-entropy. The model's
attention reads its head count from the QKV weight, so nothing else changes. The split layers declare
which dimension of each parameter they cut (``PARTITION_DIMS``); each swap records it, a ``Split("tp",
dim, t, tp_rank)``, in the rank's placement registry (``ptdp.parallel.placement``), which initialisation,
checkpoints and clipping read.

Sequence parallelism (Korthikanti et al.) keeps the residual stream between the layers ``[b, s/t, h]``:
the embedding output is scattered along the sequence (the ``SequenceEntry`` rule), column-parallel linears
all-gather it and row-parallel ones reduce-scatter, the logits all-gather it. The norms and the
row-parallel biases then see this rank's tokens only: their placements are ``partial_over`` TP (summed over
the TP group after the backward, ``ptdp.parallel.sequence.grads``), and hidden dropout draws a mask per
rank. A per-head q/k norm is partial over TP whenever t > 1: each rank holds its heads.

Multi-latent attention is split as Megatron-Core splits it: the up projections column-parallel by heads,
the down projections and latent norms whole on every rank (partial over the tokens under sequence
parallelism), the RoPE key all heads share reaching this rank's heads through ``HeadSharedInput`` (its
gradient summed over the ranks' heads). Multi-token prediction's ``eh_proj`` is column-parallel with its
output gathered (and scattered along the sequence again under sequence parallelism), its cross-entropy the
vocabulary-parallel one; the pipeline's copies of the embedding (``ptdp.parallel.pipeline.stage``) are
split like the embedding.

Applied even at t = 1 (a group of one: every collective is a no-op), so the same modules, records and
random streams run whatever the layout: attention dropout always draws from the tracker's model-parallel
stream (``ptdp.parallel.tensor.random``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ptdp.models.layers import DropoutAdd, Linear
from ptdp.models.sharding import (
    ColumnParallel,
    HeadSplit,
    PartialGradient,
    RowParallel,
    SequenceEntry,
    VocabParallel,
    VocabParallelOutput,
)
from ptdp.models.sharding import HeadSharedInput as HeadSharedRule
from ptdp.parallel.collectives import group_rank, group_size
from ptdp.parallel.placement import Placements, Split
from ptdp.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLogits,
    get_rng_tracker,
    scatter_to_sequence_parallel_region,
)
from ptdp.parallel.tensor.cross_entropy import VocabParallelCrossEntropy
from ptdp.parallel.tensor.layers import HeadSharedInput


def _swap(old: nn.Module, new: nn.Module, tp_group, placements: Placements, sp: bool) -> nn.Module:
    """``new`` replaces ``old``: its parameters keep the records of ``old``'s (e.g. the tied copy's role)
    and add the split ``new`` declares (``PARTITION_DIMS``) and, under sequence parallelism, the mark of
    those ``new`` declares partial (``SEQUENCE_PARALLEL``)."""
    for name, param in new.named_parameters(recurse=False):
        placements.replace(old._parameters[name], param)
        if name in new.PARTITION_DIMS:
            dim = new.PARTITION_DIMS[name] % param.dim()
            placements.add_split(param, Split("tp", dim, group_size(tp_group), group_rank(tp_group)))
        if sp and name in new.SEQUENCE_PARALLEL:
            placements.add_partial(param, "tp")
    return new


def column_parallel(linear: Linear, tp_group, placements: Placements, sp: bool,
                    gather_output: bool = False) -> ColumnParallelLinear:
    w = linear.weight
    fused = w.shape[0] if w.dim() == 3 else 1
    with torch.device(w.device):
        return _swap(linear, ColumnParallelLinear(
            w.shape[-1], w.shape[-2], tp_group=tp_group, bias=linear.bias is not None, fused=fused,
            gather_output=gather_output, sequence_parallel=sp, skip_bias_add=linear.skip_bias_add), tp_group,
            placements, sp)


def row_parallel(linear: Linear, tp_group, placements: Placements, sp: bool) -> RowParallelLinear:
    w = linear.weight
    with torch.device(w.device):
        return _swap(linear, RowParallelLinear(
            w.shape[1], w.shape[0], tp_group=tp_group, bias=linear.bias is not None,
            sequence_parallel=sp, skip_bias_add=linear.skip_bias_add), tp_group, placements, sp)


def vocab_parallel(table: nn.Module, tp_group, placements: Placements) -> VocabParallelEmbedding:
    """Any ``[V, h]`` table (an embedding, the untied head, the tied copy) split by vocabulary rows."""
    w = table.weight
    with torch.device(w.device):
        return _swap(table, VocabParallelEmbedding(w.shape[0], w.shape[1], tp_group=tp_group), tp_group,
                     placements, False)


def model_parallel_rng():
    """The tracker's model-parallel stream, looked up when used (``model_parallel_seed`` replaces the
    tracker after the model is built)."""
    return get_rng_tracker().fork()


def apply_tensor_parallel(model: nn.Module, tp_group, placements: Placements, *,
                          sequence_parallel: bool = False) -> nn.Module:
    """Split ``model`` (or a pipeline chunk of it) over ``tp_group`` in place, as its sharding rules say
    (``model.sharding_rules()``, ``ptdp.models.sharding``), recording the splits in ``placements``; returns it.

    On the meta device (``ptdp.parallel.parallelize``) no memory is touched; on a real device the new parameters are
    uninitialised (``ptdp.parallel.init.init_parameters`` fills them). ``sequence_parallel`` is decided by the
    caller (``ptdp.parallel.plan``: only with more than one rank in ``tp_group``).
    """
    placements.adopt(model)  # a plain model's parameters (a pipeline chunk's are recorded already)
    split = _Split(tp_group, placements, sequence_parallel)
    sharding = model.sharding_rules()
    swapped: dict[int, nn.Module] = {}  # a module under two names (the tied copy) is split once
    for name, module in list(model.named_modules(remove_duplicate=False)):
        rule = sharding.rule_for(name)
        if rule is None or not name:
            continue
        if id(module) not in swapped:
            swapped[id(module)] = _HANDLERS[type(rule)](split, module, rule) or module
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, swapped[id(module)])
    for module in model.modules():  # the shared blocks' random streams
        if hasattr(module, "dropout_rng"):  # heads are split across ranks: attention masks must differ per rank
            module.dropout_rng = model_parallel_rng
        if sequence_parallel and isinstance(module, DropoutAdd):  # each rank holds different tokens
            module.rng = model_parallel_rng
    return model


@dataclass(frozen=True)
class _Split:
    """What every rule's handler needs: the group, the registry, whether sequence parallelism is on."""

    tp_group: object
    placements: Placements
    sp: bool


def _column(split: _Split, linear: Linear, rule: ColumnParallel) -> nn.Module:
    new = column_parallel(linear, split.tp_group, split.placements, split.sp, gather_output=rule.gather_output)
    if rule.scatter_to_sequence and split.sp:  # back to this rank's tokens (multi-token prediction's eh_proj)
        new.register_forward_hook(lambda _, args, out: scatter_to_sequence_parallel_region(out, split.tp_group))
    return new


def _sequence_entry(split: _Split, module: nn.Module, rule: SequenceEntry) -> None:
    if split.sp:  # after the embedding's dropout (one mask for the full sequence, as one process draws it)
        module.register_forward_hook(lambda _, args, out: scatter_to_sequence_parallel_region(out, split.tp_group))


def _vocab_output(split: _Split, module: nn.Module, rule: VocabParallelOutput) -> nn.Module:
    if rule.kind == "cross_entropy":
        return VocabParallelCrossEntropy(split.tp_group)
    return VocabParallelLogits(module.vocab_size, tp_group=split.tp_group, sequence_parallel=split.sp,
                               softcap=module.softcap)


def _partial(split: _Split, module: nn.Module, rule: PartialGradient) -> None:
    """Heads are split whenever t > 1; tokens only under sequence parallelism."""
    if (rule.over == "heads" and group_size(split.tp_group) > 1) or (rule.over == "tokens" and split.sp):
        for param in module.parameters():
            split.placements.add_partial(param, "tp")


def _head_split(split: _Split, module: nn.Module, rule: HeadSplit) -> None:
    """In place, this rank's rows (dim 0, the heads in order) of each of the module's own parameters: rows
    ``[r·n/t, (r+1)·n/t)``, the heads the column-parallel projections give it. The counts of heads the rule
    names (``HeadSplit.head_counts``) become this rank's."""
    t, rank = group_size(split.tp_group), group_rank(split.tp_group)
    for count in rule.head_counts:
        setattr(module, count, getattr(module, count) // t)
    for name, param in list(module._parameters.items()):
        if param is None:
            continue
        rows = param.shape[0] // t
        piece = nn.Parameter(param.new_empty((rows, *param.shape[1:])) if param.is_meta
                             else param.detach().narrow(0, rank * rows, rows).clone(), requires_grad=param.requires_grad)
        split.placements.replace(param, piece)
        split.placements.add_split(piece, Split("tp", 0, t, rank))
        module._parameters[name] = piece


# One handler per rule kind (a new kind of rule is a handler here, not a branch): each returns the module
# that takes the old one's place, or None to keep it (marked or hooked).
_HANDLERS: dict[type, Callable[[_Split, nn.Module, Any], nn.Module | None]] = {
    ColumnParallel: _column,
    RowParallel: lambda split, linear, rule: row_parallel(linear, split.tp_group, split.placements, split.sp),
    VocabParallel: lambda split, table, rule: vocab_parallel(table, split.tp_group, split.placements),
    VocabParallelOutput: _vocab_output,
    SequenceEntry: _sequence_entry,
    HeadSharedRule: lambda split, module, rule: HeadSharedInput(split.tp_group, split.sp),
    HeadSplit: _head_split,
    PartialGradient: _partial,
}
