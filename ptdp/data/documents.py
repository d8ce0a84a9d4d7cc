"""Document boundaries inside a packed sample: Megatron's ``--reset-position-ids``, ``--reset-attention-mask``
and ``--eod-mask-loss`` (docs/references.md, §Packed sequences; docs/packing.md), as plain numbers.

A GPT sample is a window of ``s + 1`` tokens of concatenated documents, each ended by the end-of-document
token (EOD). Megatron's ``_get_ltor_masks_and_position_ids`` reads the INPUTS ``tokens = text[:-1]``:

* a document ends right after each EOD input token (the EOD belongs to the document it ends): with
  ``--reset-attention-mask`` token i attends only to tokens j <= i of its own document;
* with ``--reset-position-ids`` positions restart at 0 on the token after each EOD;
* with ``--eod-mask-loss`` the positions whose input is EOD leave the loss: the prediction made AT an
  EOD token, of the next document's first token, which under the document mask sees nothing of that
  document. (Megatron's code masks ``tokens == eod``; with that rule a packed sample's loss is exactly the
  documents' losses run one by one.)

Here the boundaries are ``cu_seqlens`` per sample -- the cumulative document lengths ``[0, e1 + 1, ...,
s]`` (Megatron-Core's THD packing) -- computed on the host from the numpy sample: no s x s mask is ever
built. The model reads them through ``ptdp.models.documents.DocumentLayout``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DocumentOptions:
    """Megatron's three GPTDataset flags and the end-of-document id they read."""

    eod: int
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    sft: bool = False  # --sft: boundaries and loss weights come from the dataset (ptdp.data.sft_dataset)

    @property
    def any(self) -> bool:
        return self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss or self.sft

    @property
    def masks_loss(self) -> bool:
        """Whether some positions leave the loss (per-token weights instead of the plain mean)."""
        return self.eod_mask_loss or self.sft


def sample_bounds(dataset, i: int, options: DocumentOptions) -> tuple[int, ...]:
    """``cu_seqlens`` of sample ``i`` of ``dataset``: from an SFT dataset's packing with ``--sft``, else
    found by the end-of-document tokens of its inputs."""
    if options.sft:
        member, k = dataset.locate(i)
        return member.sft_sample(k)[2]
    return cu_seqlens(np.asarray(dataset[i])[:-1], options.eod)


def cu_seqlens(tokens: np.ndarray, eod: int) -> tuple[int, ...]:
    """``(0, e1 + 1, e2 + 1, ..., s)`` for the inputs ``tokens`` (``[s]``): a document ends after each EOD.
    An EOD as the last input ends the last document at s itself (no empty document is listed)."""
    ends = np.flatnonzero(np.asarray(tokens) == eod) + 1
    s = len(tokens)
    return (0, *(int(e) for e in ends if e < s), s)


def positions(bounds: Sequence[int]) -> np.ndarray:
    """``[s]`` int64 position ids restarting at 0 at every document start (``--reset-position-ids``)."""
    s = bounds[-1]
    starts = np.repeat(np.asarray(bounds[:-1], dtype=np.int64), np.diff(bounds))
    return np.arange(s, dtype=np.int64) - starts


def loss_mask(tokens: np.ndarray, eod: int) -> np.ndarray:
    """``[..., s]`` float32, 0 where the input is EOD (``--eod-mask-loss``), 1 elsewhere."""
    return (np.asarray(tokens) != eod).astype(np.float32)


def attention_pairs(bounds: Sequence[int]) -> int:
    """Query-key pairs causal attention computes inside the documents: sum of l(l+1)/2 (a full causal
    window computes s(s+1)/2). The FLOP counters' attention term is proportional to sum of l^2."""
    lengths = np.diff(np.asarray(bounds, dtype=np.int64))
    return int((lengths * (lengths + 1) // 2).sum())


def squared_lengths(bounds: Sequence[int]) -> int:
    """sum of l_i^2 over the documents of one sample (eq. 3's attention term per document)."""
    lengths = np.diff(np.asarray(bounds, dtype=np.int64))
    return int((lengths * lengths).sum())
