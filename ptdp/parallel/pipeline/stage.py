"""Pipeline splitting of a plain model into chunks, and the tied embedding: its one home.

The layers are split over the p·v virtual stages evenly or as Megatron's layout flags say
(``ptdp.schedule.layout``); a rank holds the stages its schedule's placement
gives it (``virtual_stage``: Megatron's interleaving, with p=4, v=2 and 8 layers rank 0 holds layers 0 and
4, or a V: zbv, v-half, v-min rank 0 holds layers 0 and 7). A chunk is the model itself with only its parts
kept, as the model declares them (``pipeline_parts()``, ``ptdp.models.parts``; read through
``ptdp.parallel.pipeline.parts``, so nothing here names one model class's attributes): the first-stage
parts (the input embedding) on virtual stage 0, the last-stage parts (the final norm, the output layer,
multi-token prediction) on the last, its layers under their global indices (names, hence checkpoints, do
not depend on the layout).

Tied embeddings (GPT-2: the logits' weight is the input embedding). When the first and last stage are
different chunks, the last one holds a copy of the table under the declared ``head_copy`` name, recorded
with the role ``embedding_copy`` (``ptdp.parallel.placement``): it is initialised as the embedding (the
record's ``logical_name`` is the table's name), saved once (checkpoints skip the copy), counted once in the
grad norm (``Placement.counts_in_norm``), kept apart in the gradient buffers (:func:`tied_embedding_weights`)
and its gradient summed with the embedding's after every backward (:func:`sync_embedding_grads`), as
Megatron does, so the two copies stay equal.

Multi-token prediction places its modules with the final norm, on the last stage (Megatron's default); they
embed tokens too, so the last stage then keeps a copy of the whole input embedding under the declared
``embedding_copy`` name (the tied copy is its table), a copy of the same kind, summed over the same group
(Megatron-Core's ``mtp_process`` stage does the same).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from torch import nn

from ptdp.parallel.collectives import all_reduce
from ptdp.parallel.pipeline.parts import ChunkParts
from ptdp.parallel.placement import Placement, Placements
from ptdp.schedule.layout import Stage, stages_from_counts


def split_model(model: nn.Module, stages: Sequence[int], num_stages: int, placements: Placements,
                plan: Sequence[Stage] | None = None) -> list[nn.Module]:
    """One chunk per virtual stage in ``stages`` (of ``num_stages``), each a copy of ``model`` (built on the
    meta device: copying costs nothing) with only that stage's parts: the layers ``plan`` gives it
    (``ptdp.schedule.layout``: Megatron's uneven layouts), or an even share. Every parameter of the chunks
    is recorded in ``placements`` under its full-model name, whole (the later steps split it)."""
    plan = plan or stages_from_counts([len(ChunkParts(model).layers) // num_stages] * num_stages)
    chunks = []
    for stage in stages:
        chunk = copy.deepcopy(model)
        parts = ChunkParts(chunk)
        names, layers = parts.names, parts.layers
        keep = {str(i) for i in plan[stage].layers}
        for name in [n for n in layers if n not in keep]:
            del layers[name]
        first, last = stage == 0, stage == num_stages - 1
        if not last:
            for name in names.last:
                parts.set(name, None)
        if not first:
            if last and parts.multi_token_prediction is not None:  # it embeds tokens: keep a copy
                parts.set(names.mtp_copy, parts.input_embedding)
            if last and parts.untied_output is None:  # tied, the embedding elsewhere: keep a copy of its table
                parts.set(names.head_copy, parts.table(parts.input_embedding))
            for name in names.first:
                parts.set(name, None)
        for name, param in chunk.named_parameters():
            role = "embedding_copy" if name in names.copies else "dense"
            placements.record(param, Placement(names.logical_name(name), role=role))
        chunks.append(chunk)
    return chunks


def is_first(chunk: nn.Module) -> bool:
    return ChunkParts(chunk).is_first()


def is_last(chunk: nn.Module) -> bool:
    return ChunkParts(chunk).is_last()


def _word_embedding(chunk: nn.Module) -> nn.Parameter:
    """The chunk's copy of the input embedding's table: its own (first stage), or the last stage's copy."""
    parts = ChunkParts(chunk)
    embedding = parts.input_embedding or parts.mtp_copy
    return parts.head_copy.weight if embedding is None else parts.table(embedding).weight


def tied_embedding_weights(chunks: Sequence[nn.Module], p: int) -> list[nn.Parameter]:
    """This rank's copies of the input embedding when there are two (p > 1, tied or with multi-token
    prediction): the optimizer keeps them in a separate gradient bucket (their gradients are summed across
    stages before the data-parallel sync)."""
    cfg = chunks[0].cfg
    if p == 1 or not (cfg.tied_embeddings or cfg.mtp_num_layers) or hasattr(chunks[0], "vocab_slices"):
        return []  # vocabulary parallelism: one slice per rank serves both ends
    return [_word_embedding(c) for c in chunks if is_first(c) or is_last(c)]


def sync_embedding_grads(chunks: Sequence[nn.Module], p: int, embedding_group) -> None:
    """Sum the gradients of the input embedding's two copies (first and last stage), as Megatron does: on
    this rank when a V placement holds both, else over the embedding group (first and last stage)."""
    if not tied_embedding_weights(chunks, p):
        return
    ends = [chunk for chunk in chunks if is_first(chunk) or is_last(chunk)]
    if not all(_word_embedding(chunk).requires_grad for chunk in ends):  # frozen (LoRA): no gradient to sum
        return
    if len(ends) == 2:  # a V placement: both copies live on this rank
        first, last = (_word_embedding(chunk).main_grad for chunk in ends)
        first.add_(last)
        last.copy_(first)
        return
    if embedding_group is None:
        return
    for chunk in ends:
        all_reduce(_word_embedding(chunk).main_grad, embedding_group)  # fp32 with --bf16
