"""Context parallelism applied to a plain model: the sequence of every sample split over c ranks.

A CP rank holds two load-balanced chunks of each sequence (``ptdp.parallel.context.attention``). Everything in the
model but attention is per token, so two swaps suffice: the model's ``SequencePositions`` (read by learned
position embeddings and rotary tables) becomes the real positions of this rank's tokens, and every
``CausalAttention`` core becomes the context-parallel one (``--cp-comm-type``: ring, Ulysses all-to-all or
all-gather), keeping its layer's sliding window (``ptdp.parallel.context.window``) and soft-cap and taking its
sinks (inside packed documents: ``ptdp.parallel.context.document_window``); a Gated DeltaNet layer's sequence mixing becomes ``ptdp.parallel.context.linear``'s. Multi-token prediction reads tokens k places ahead, which may sit in another rank's
chunk: its ``ShiftLabels`` becomes :class:`ContextParallelShift`, which gathers the labels of the CP group
(integers: b·s of them), shifts them in sequence order and keeps this rank's chunks. Multi-latent attention
inside packed documents reaches the document kernels through ``ptdp.models.documents.equal_widths``. The
data loader shards the tokens the same way (``ptdp.train.batches.cp_shard``); gradients are averaged over
the d·c ranks of the dp-cp group (``ptdp.parallel.dims``).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ptdp.models import CausalAttention, SequencePositions
from ptdp.models.documents import DocumentLayout, equal_widths, masks_attention
from ptdp.models.mtp import ShiftLabels
from ptdp.parallel.collectives import all_gather, group_rank, group_size
from ptdp.parallel.context.attention import (
    context_parallel_attention,
    load_balanced_positions,
    natural_order,
    shard_sequence,
)
from ptdp.parallel.context.document_window import document_window_context_attention
from ptdp.parallel.context.documents import document_context_attention
from ptdp.parallel.context.linear import apply_linear_context_parallel


class LoadBalancedPositions(SequencePositions):
    """The real positions of CP rank ``cp_rank``'s ``seq_len`` tokens (chunks i and 2c-1-i)."""

    def __init__(self, cp_size: int, cp_rank: int):
        super().__init__()
        self.cp_size, self.cp_rank = cp_size, cp_rank

    def forward(self, seq_len: int, device: torch.device) -> torch.Tensor:
        return load_balanced_positions(seq_len * self.cp_size, self.cp_size, self.cp_rank, device=device)


class ContextParallelAttention(CausalAttention):
    """Causal attention of this rank's queries over the whole sequence, through the CP group; inside each
    document when a packed microbatch's layout masks attention (``ptdp.parallel.context.documents``)."""

    def __init__(self, cp_group, comm_type: str, window: int | None = None, softcap: float | None = None):
        super().__init__(window, softcap)
        self.cp_group, self.comm_type = cp_group, comm_type

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                documents: DocumentLayout | None = None, scale: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if masks_attention(documents):
            if dropout_p > 0.0:
                raise ValueError("--attention-dropout > 0 is not supported with --context-parallel-size > 1")
            if self.window is not None or sinks is not None or self.softcap is not None:
                return document_window_context_attention(q, k, v, documents, cp_group=self.cp_group,
                                                         comm_type=self.comm_type, scale=scale, window=self.window,
                                                         sinks=sinks, softcap=self.softcap)
            return equal_widths(functools.partial(document_context_attention, documents=documents,
                                                  cp_group=self.cp_group, comm_type=self.comm_type), q, k, v, scale)
        return context_parallel_attention(q, k, v, cp_group=self.cp_group, comm_type=self.comm_type,
                                          dropout_p=dropout_p, softmax_scale=scale, window=self.window, sinks=sinks,
                                          softcap=self.softcap)


class ContextParallelShift(ShiftLabels):
    """``ShiftLabels`` over the whole sequence of the CP group: labels gathered once per microbatch (the
    modules shift the same labels), shifted in sequence order, this rank's chunks kept; the mean over the
    positions whose target exists is this rank's share of the sequence's (the CP ranks' losses are
    averaged, as the LM loss's are)."""

    def __init__(self, cp_group):
        super().__init__()
        self.cp_group, self.cp_size, self.cp_rank = cp_group, group_size(cp_group), group_rank(cp_group)
        self._whole: tuple[torch.Tensor, torch.Tensor] | None = None

    def _sequence(self, labels: torch.Tensor) -> torch.Tensor:
        if self._whole is None or self._whole[0] is not labels:
            order, _ = natural_order(self.cp_size, labels.shape[1] // 2, labels.device)
            self._whole = labels, all_gather(labels, self.cp_group, dim=1).index_select(1, order)
        return self._whole[1]

    def forward(self, labels: torch.Tensor, places: int) -> torch.Tensor:
        if places == 0:
            return labels
        whole = super().forward(self._sequence(labels), places)
        return shard_sequence(whole, self.cp_size, self.cp_rank, dim=1)

    def mean(self, values: torch.Tensor, places: int) -> torch.Tensor:
        b, s = values.shape
        return values.sum() * self.cp_size / (b * (s * self.cp_size - places))


def swap_modules(model: nn.Module, kind: type[nn.Module], new: nn.Module) -> None:
    """Replace every submodule of exactly type ``kind``, wherever (and however often) it appears, by ``new``."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is kind:
                setattr(parent, name, new)


def apply_context_parallel(model: nn.Module, cp_group, comm_type: str = "p2p",
                           linear_comm_type: str = "state_passing") -> nn.Module:
    """Make ``model`` (or a chunk) run on this CP rank's tokens; nothing to do when c = 1. Returns it. The
    Gated DeltaNet layers mix their sequence the ``linear_comm_type`` way (``ptdp.parallel.context.linear``)."""
    if group_size(cp_group) == 1:
        return model
    swap_modules(model, SequencePositions, LoadBalancedPositions(group_size(cp_group), group_rank(cp_group)))
    for parent in list(model.modules()):  # one core per layer: each keeps its layer's sliding window
        for name, child in list(parent.named_children()):
            if type(child) is CausalAttention:
                setattr(parent, name, ContextParallelAttention(cp_group, comm_type, child.window, child.softcap))
    swap_modules(model, ShiftLabels, ContextParallelShift(cp_group))
    apply_linear_context_parallel(model, cp_group, linear_comm_type)
    return model
