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

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ptdp.ops.document_attention import DocumentAttention
from ptdp.ops.fused import outside_compile


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

    @outside_compile  # --compile: the kernels loop over host boundaries; a compiled layer calls out here
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
               scale: float | None = None) -> torch.Tensor:
        """Document-causal attention of q, k, v ``[b, heads, s, d]`` over whole samples (``scale`` and a
        value width of its own: :func:`equal_widths`)."""
        return equal_widths(lambda q, k, v: self.attention(q, k, v, self.bounds, dropout_p, self.cache),
                            q, k, v, scale)


def equal_widths(kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], q: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """``kernel(q, k, v)`` (a document kernel: equal head widths, softmax scale 1/√width) on multi-latent
    attention's heads: values narrower than the keys and a softmax ``scale`` of their own. Zero columns
    pad q, k and v to one width w (scores and outputs unchanged), q is multiplied by scale·√w (the kernel's
    1/√w then gives ``scale``), and the output keeps v's columns. Plain heads pass through untouched."""
    d, dv = q.shape[-1], v.shape[-1]
    if scale is None and dv == d:
        return kernel(q, k, v)
    width = max(d, dv)
    q = q * ((d ** -0.5 if scale is None else scale) * math.sqrt(width))
    q, k, v = (F.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x for x in (q, k, v))
    return kernel(q, k, v)[..., :dv]


def position_ids(documents: DocumentLayout | None) -> torch.Tensor | None:
    """The layout's ``[b, local tokens]`` position ids, or None: the model's ``SequencePositions``."""
    return None if documents is None else documents.positions


def masks_attention(documents: DocumentLayout | None) -> bool:
    return documents is not None and documents.attention is not None
