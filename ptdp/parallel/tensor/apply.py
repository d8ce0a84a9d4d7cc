"""Tensor (and sequence) parallelism applied to a plain model: swap its blocks for split ones, by name.

Megatron's plan (paper §2.3): in each layer the QKV and fc1 projections become column-parallel (each rank
its a/t heads, its ffn/t columns) and the attention and fc2 output projections row-parallel (``g`` sums
the partial products); the embedding and the output weight are split by vocabulary rows, and the logits
stay split for the vocabulary-parallel cross-entropy. The model's attention reads its head count from the
QKV weight, so nothing else changes. The split layers declare which dimension of each parameter they cut
(``PARTITION_DIMS``); each swap records it, a ``Split("tp", dim, t, tp_rank)``, in the rank's placement
registry (``ptdp.parallel.placement``), which initialisation, checkpoints and clipping read.

Sequence parallelism (Korthikanti et al.) keeps the residual stream between the layers ``[b, s/t, h]``:
the embedding output is scattered along the sequence, column-parallel linears all-gather it and
row-parallel ones reduce-scatter, the logits all-gather it. LayerNorm and the row-parallel biases then see
this rank's tokens only: their placements are ``sequence_parallel`` (their grads are summed over the TP
group after the backward, ``ptdp.parallel.sequence.grads``), and hidden dropout draws a mask per rank.

Applied even at t = 1 (a group of one: every collective is a no-op), so the same modules, records and
random streams run whatever the layout: attention dropout always draws from the tracker's model-parallel
stream (``ptdp.parallel.tensor.random``).
"""

from __future__ import annotations

import torch
from torch import nn

from ptdp.models import Attention, GPTModel, Linear
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
            placements.update(param, sequence_parallel=True)
    return new


def column_parallel(linear: Linear, tp_group, placements: Placements, sp: bool) -> ColumnParallelLinear:
    w = linear.weight
    fused = w.shape[0] if w.dim() == 3 else 1
    with torch.device(w.device):
        return _swap(linear, ColumnParallelLinear(
            w.shape[-1], w.shape[-2], tp_group=tp_group, bias=linear.bias is not None, fused=fused,
            sequence_parallel=sp, skip_bias_add=linear.skip_bias_add), tp_group, placements, sp)


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


def apply_tensor_parallel(model: GPTModel, tp_group, placements: Placements, *,
                          sequence_parallel: bool = False) -> GPTModel:
    """Split ``model`` (or a pipeline chunk of it) over ``tp_group`` in place, recording the splits in
    ``placements``; returns it.

    On the meta device (``ptdp.parallel.parallelize``) no memory is touched; on a real device the new parameters are
    uninitialised (``ptdp.parallel.init.init_parameters`` fills them).
    """
    sp = sequence_parallel and group_size(tp_group) > 1
    fork = model_parallel_rng
    placements.adopt(model)  # a plain model's parameters (a pipeline chunk's are recorded already)
    if model.embedding is not None:
        model.embedding.word_embeddings = vocab_parallel(model.embedding.word_embeddings, tp_group, placements)
        if sp:  # after the embedding's dropout (one mask for the full sequence, as one process draws it)
            model.embedding.register_forward_hook(
                lambda module, args, out: scatter_to_sequence_parallel_region(out, tp_group))
    for layer in model.layers.values():
        attention, mlp = layer.attention, layer.mlp
        if isinstance(attention, Attention):  # multi-latent attention runs at t = 1 only for now (issue 41)
            attention.qkv = column_parallel(attention.qkv, tp_group, placements, sp)
            attention.proj = row_parallel(attention.proj, tp_group, placements, sp)
        attention.dropout_rng = fork  # heads are split across ranks: masks must differ per rank
        if hasattr(mlp, "fc1"):  # a mixture of experts is split by its own layout (ptdp.parallel.expert.apply)
            mlp.fc1 = column_parallel(mlp.fc1, tp_group, placements, sp)
            mlp.fc2 = row_parallel(mlp.fc2, tp_group, placements, sp)
        if sp:  # each rank holds different tokens: independent masks
            layer.dropout_add.rng = fork
    if model.lm_head is not None:
        model.lm_head = vocab_parallel(model.lm_head, tp_group, placements)
    if model.output_layer is not None:
        model.output_layer = vocab_parallel(model.output_layer, tp_group, placements)
    if model.final_layernorm is not None:
        model.logits = VocabParallelLogits(model.vocab_size, tp_group=tp_group, sequence_parallel=sp)
    if sp:
        for name, param in model.named_parameters():
            if "layernorm" in name:
                placements.update(param, sequence_parallel=True)  # partial sums over this rank's tokens
    return model
