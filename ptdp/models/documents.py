"""The per-forward document layout: how a packed microbatch's documents reach the model's positions and
attention (docs/packing.md).

``GPTModel.forward(x, documents)`` passes one :class:`DocumentLayout` down to the embedding (position ids)
and every attention (rotary tables, the attention core); ``None`` is the plain window (positions 0..s-1,
causal attention over the whole window). The batch source makes one per microbatch
(``ptdp.train.batches.Microbatches.documents``) and every pipeline stage gets it from its own batch
source, with the microbatch: nothing of it travels between stages. Under context parallelism the layout
holds this rank's share of the positions and the whole sample's boundaries, which the context-parallel
attention intersects with the rank's chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ptdp.ops.document_attention import DocumentAttention


@dataclass(eq=False)
class DocumentLayout:
    """One microbatch's documents.

    ``bounds``: per sample, its ``cu_seqlens`` over the whole sample ``(0, ..., s)`` (host integers: the
    kernels loop over them without a device sync). ``positions``: ``[b, local tokens]`` position ids of the
    tokens this process holds, restarting after each end of document (``--reset-position-ids``), or None
    (the model's own). ``attention``: the kernel that keeps attention inside the documents
    (``--reset-attention-mask``), or None (causal over the whole window). ``cache``: what the layers share
    for this microbatch (block masks, rotary tables), built on first use.
    """

    bounds: Sequence[Sequence[int]]
    positions: torch.Tensor | None = None
    attention: DocumentAttention | None = None
    cache: dict = field(default_factory=dict)

    @torch.compiler.disable  # --compile: the kernels loop over host boundaries; a compiled layer calls out here
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        """Document-causal attention of q, k, v ``[b, heads, s, d]`` over whole samples."""
        return self.attention(q, k, v, self.bounds, dropout_p, self.cache)


def position_ids(documents: DocumentLayout | None) -> torch.Tensor | None:
    """The layout's ``[b, local tokens]`` position ids, or None: the model's ``SequencePositions``."""
    return None if documents is None else documents.positions


def masks_attention(documents: DocumentLayout | None) -> bool:
    return documents is not None and documents.attention is not None
