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

Multi-latent attention (issue 41) is split as Megatron-Core splits it: the up projections (``q_proj`` or
``q_up_proj``, ``kv_up_proj``) column-parallel by heads, ``proj`` row-parallel; the down projections and
the latent norms stay whole on every rank (``duplicated``: under sequence parallelism they see this rank's
tokens, so their placements are ``sequence_parallel``, and the up projections gather the sequence); the
RoPE key all heads share reaches this rank's heads through ``HeadSharedInput`` (its gradient summed over
the ranks' heads; under sequence parallelism all-gathered). Multi-token prediction's modules: their
transformer layers as the model's, ``eh_proj`` column-parallel with its output gathered (and scattered
along the sequence again under sequence parallelism, as Megatron-Core), their cross-entropy the
vocabulary-parallel one, the embedding copy (``ptdp.parallel.pipeline.stage``) split like the embedding.

Applied even at t = 1 (a group of one: every collective is a no-op), so the same modules, records and
random streams run whatever the layout: attention dropout always draws from the tracker's model-parallel
stream (``ptdp.parallel.tensor.random``).
"""

from __future__ import annotations

import torch
from torch import nn

from ptdp.models import Embedding, GPTModel, Linear, MultiLatentAttention
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
            placements.update(param, sequence_parallel=True)
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


def _split_mla(attention: MultiLatentAttention, tp_group, placements: Placements, sp: bool) -> None:
    """Megatron-Core's split of multi-latent attention (module docstring)."""
    for name in ("q_proj", "q_up_proj", "kv_up_proj"):
        linear = getattr(attention, name)
        if linear is not None:
            setattr(attention, name, column_parallel(linear, tp_group, placements, sp))
    attention.proj = row_parallel(attention.proj, tp_group, placements, sp)
    attention.rope_key_region = HeadSharedInput(tp_group, sp)
    for down in (attention.q_down_proj, attention.kv_down_proj):
        for param in down.parameters() if down is not None and sp else ():
            placements.update(param, sequence_parallel=True)  # partial sums over this rank's tokens


def _split_embedding(model: GPTModel, embedding: Embedding, tp_group, placements: Placements, sp: bool) -> None:
    """The embedding (or the last stage's copy, and with it the tied copy it holds) split by vocabulary."""
    table = embedding.word_embeddings
    embedding.word_embeddings = vocab_parallel(table, tp_group, placements)
    if model.output_layer is table:  # the tied copy is this table
        model.output_layer = embedding.word_embeddings
    if sp:  # after the embedding's dropout (one mask for the full sequence, as one process draws it)
        embedding.register_forward_hook(lambda module, args, out: scatter_to_sequence_parallel_region(out, tp_group))


def model_parallel_rng():
    """The tracker's model-parallel stream, looked up when used (``model_parallel_seed`` replaces the
    tracker after the model is built)."""
    return get_rng_tracker().fork()


def apply_tensor_parallel(model: GPTModel, tp_group, placements: Placements, *,
                          sequence_parallel: bool = False) -> GPTModel:
    """Split ``model`` (or a pipeline chunk of it) over ``tp_group`` in place, recording the splits in
    ``placements``; returns it.

    On the meta device (``ptdp.parallel.parallelize``) no memory is touched; on a real device the new parameters are
    uninitialised (``ptdp.parallel.init.init_parameters`` fills them). ``sequence_parallel`` is decided by the
    caller (``ptdp.parallel.plan``: only with more than one rank in ``tp_group``).
    """
    fork = model_parallel_rng
    placements.adopt(model)  # a plain model's parameters (a pipeline chunk's are recorded already)
    for embedding in (model.embedding, model.embedding_copy):
        if embedding is not None:
            _split_embedding(model, embedding, tp_group, placements, sequence_parallel)
    mtp = [] if model.mtp is None else list(model.mtp.layers.values())
    for module in mtp:  # issue 41: multi-token prediction's own projection, as Megatron-Core splits it
        module.eh_proj = column_parallel(module.eh_proj, tp_group, placements, sequence_parallel,
                                         gather_output=True)
        if sequence_parallel:  # back to this rank's tokens before its transformer layer
            module.eh_proj.register_forward_hook(
                lambda _, args, out: scatter_to_sequence_parallel_region(out, tp_group))
    if model.mtp is not None:
        model.mtp.cross_entropy = VocabParallelCrossEntropy(tp_group)
    for layer in [*model.layers.values(), *(module.transformer_layer for module in mtp)]:
        attention, mlp = layer.attention, layer.mlp
        if isinstance(attention, MultiLatentAttention):
            _split_mla(attention, tp_group, placements, sequence_parallel)
        else:
            attention.qkv = column_parallel(attention.qkv, tp_group, placements, sequence_parallel)
            attention.proj = row_parallel(attention.proj, tp_group, placements, sequence_parallel)
        attention.dropout_rng = fork  # heads are split across ranks: masks must differ per rank
        if hasattr(mlp, "fc1"):  # a mixture of experts is split by its own layout (ptdp.parallel.expert.apply)
            mlp.fc1 = column_parallel(mlp.fc1, tp_group, placements, sequence_parallel)
            mlp.fc2 = row_parallel(mlp.fc2, tp_group, placements, sequence_parallel)
        if sequence_parallel:  # each rank holds different tokens: independent masks
            layer.dropout_add.rng = fork
    if model.lm_head is not None:
        model.lm_head = vocab_parallel(model.lm_head, tp_group, placements)
    if model.output_layer is not None and not isinstance(model.output_layer, VocabParallelEmbedding):
        model.output_layer = vocab_parallel(model.output_layer, tp_group, placements)
    if model.final_layernorm is not None:
        model.logits = VocabParallelLogits(model.vocab_size, tp_group=tp_group, sequence_parallel=sequence_parallel)
    if sequence_parallel:
        for name, param in model.named_parameters():
            if "layernorm" in name:
                placements.update(param, sequence_parallel=True)  # partial sums over this rank's tokens
    return model
