"""Chat conversations packed whole into samples, with their loss weights: what ``ptdp train --sft`` reads.

``ptdp preprocess --sft`` writes each conversation as one sequence of ``PREFIX.bin/.idx`` and its assistant
mask as the same sequence of ``PREFIX_loss_mask.bin/.idx`` (``preprocess_sft.py``). A sample holds
``seq_length + 1`` tokens (inputs ``[:-1]``, labels ``[1:]``, as every GPT sample):

1. **Order.** Epoch by epoch, the split's conversations are shuffled by ``numpy.random.RandomState(seed)``
   and packed greedily in that order: a conversation goes into the current sample if it fits in what is
   left of its ``s + 1`` tokens, else it starts the next sample; the rest of a sample is padding (the
   tokenizer's end-of-document id, no loss). Epochs are added until there are ``num_samples`` samples
   (None: one epoch), and the samples are shuffled by the same RandomState. No conversation is ever cut
   across two samples.
2. **Too long.** A conversation of more than ``s + 1`` tokens (``s`` predictions) is refused with one line
   naming it, or with ``--sft-truncate`` keeps its first ``s + 1`` tokens.
3. **Loss weights.** Position ``i`` (input ``i``, label ``i + 1``) weighs 1 when the label is an assistant
   token of the same conversation as the input, else 0: prompts, the template's headers, the first token of
   the next conversation and the padding carry no loss.
4. **Boundaries.** ``cu_seqlens`` over the inputs: each conversation's start, the padding's start, ``s``.
   Training turns on ``--reset-position-ids`` and ``--reset-attention-mask`` with them (``ptdp.data.documents``),
   so attention and positions stop at each conversation's end: a packed sample computes exactly what each
   conversation alone would.

``--data-cache-path`` keeps the three index arrays as ``.npy`` like ``GPTDataset`` (the key names the SFT
order). The order is ptdp's own: Megatron-LM's SFT dataset does not pack this way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ptdp.data.errors import DataError
from ptdp.data.gpt_dataset import _cached
from ptdp.data.indexed_dataset import IndexedDataset

LOSS_MASK_SUFFIX = "_loss_mask"


@dataclass(frozen=True)
class SFTOptions:
    """``--sft``: the id that pads a sample's end, and ``--sft-truncate``."""

    pad: int
    truncate: bool = False


def pack(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Start positions (into ``lengths``' order) of the greedily packed samples, plus ``len(lengths)``."""
    if len(lengths) == 0:
        return np.zeros(1, np.int64)
    starts, used = [0], 0
    for k, n in enumerate(lengths.tolist()):
        if used + n > capacity and used:
            starts.append(k)
            used = 0
        used += n
    starts.append(len(lengths))
    return np.asarray(starts, dtype=np.int64)


def build_sft_indices(lengths: np.ndarray, documents: np.ndarray, capacity: int, seed: int,
                      num_samples: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document_index: conversation ids in packed order, sample_index: each sample's first position in it
    (plus the end), shuffle_index) -- the module docstring's order."""
    rng = np.random.RandomState(seed)
    doc_parts, starts, count, offset = [], [np.zeros(1, np.int64)], 0, 0
    while True:
        order = np.asarray(documents, dtype=np.int32).copy()
        rng.shuffle(order)
        bounds = pack(np.minimum(lengths[order], capacity), capacity)
        doc_parts.append(order)
        starts.append(bounds[1:] + offset)
        offset += len(order)
        count += len(bounds) - 1
        if num_samples is None or count >= num_samples or len(order) == 0:
            break
    shuffle = np.arange(count, dtype=np.int64)
    rng.shuffle(shuffle)
    return np.concatenate(doc_parts), np.concatenate(starts), shuffle


class SFTDataset:
    """Samples of whole conversations of ``indexed`` (sequences ``document_range``), GPTDataset's interface plus
    :meth:`sft_sample` (tokens, loss weights, boundaries); module docstring."""

    def __init__(self, indexed: IndexedDataset, document_range: tuple[int, int], seq_length: int, seed: int,
                 num_samples: int | None, cache_path: str | None, split: str, options: SFTOptions) -> None:
        self.indexed, self.seq_length, self.seed, self.num_samples = indexed, seq_length, seed, num_samples
        self.document_range, self.options = (int(document_range[0]), int(document_range[1])), options
        mask_prefix = indexed.prefix + LOSS_MASK_SUFFIX
        if not os.path.exists(mask_prefix + ".idx"):
            raise DataError(f"--sft: {indexed.prefix} has no loss mask ({mask_prefix}.bin/.idx); prepare the chat "
                            "data with `ptdp preprocess --sft`")
        self.masks = IndexedDataset(mask_prefix)
        if not np.array_equal(np.asarray(self.masks.sequence_lengths), np.asarray(indexed.sequence_lengths)):
            raise DataError(f"--sft: {mask_prefix} does not match {indexed.prefix} (other sequence lengths); "
                            "rerun `ptdp preprocess --sft`")
        lo, hi = self.document_range
        lengths = np.asarray(indexed.sequence_lengths, dtype=np.int64)
        capacity = seq_length + 1
        too_long = np.flatnonzero(lengths[lo:hi] > capacity)
        if len(too_long) and not options.truncate:
            k = lo + int(too_long[0])
            raise DataError(f"--sft: conversation {k + 1} of {indexed.prefix} has {int(lengths[k])} tokens, more "
                            f"than --seq-length + 1 = {capacity} ({len(too_long)} such); raise --seq-length or "
                            "pass --sft-truncate to keep their first tokens")
        self.tokens_per_epoch = int(np.minimum(lengths[lo:hi], capacity).sum())
        description = {"prefix": os.path.abspath(indexed.prefix), "idx_size": os.path.getsize(indexed.prefix + ".idx"),
                       "range": [lo, hi], "seq_length": seq_length, "seed": seed, "num_samples": num_samples,
                       "split": split, "order": "sft-packed"}
        documents = np.arange(lo, hi, dtype=np.int32)
        self.document_index, self.sample_index, self.shuffle_index = _cached(
            cache_path, description, lambda: build_sft_indices(lengths, documents, capacity, seed, num_samples))

    def __len__(self) -> int:
        return int(len(self.sample_index) - 1)

    def conversations(self, i: int) -> list[tuple[int, int]]:
        """(conversation id, tokens used) of sample ``i``, in order (wrapping past the end)."""
        n = len(self)
        if i < 0 or n == 0:
            raise IndexError(f"sample index {i} out of range for a dataset of {n} samples")
        j = int(self.shuffle_index[i % n])
        docs = self.document_index[int(self.sample_index[j]):int(self.sample_index[j + 1])]
        cap = self.seq_length + 1
        return [(int(d), min(int(self.indexed.sequence_lengths[d]), cap)) for d in docs]

    def locate(self, i: int) -> tuple[SFTDataset, int]:
        return self, int(i)

    def document_ids(self, i: int) -> list[int]:
        return [d for d, _ in self.conversations(int(i))]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.sft_sample(i)[0]

    def sft_sample(self, i: int) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
        """(tokens ``[s + 1]`` int64, loss weights ``[s]`` float32 of the positions, ``cu_seqlens`` of the
        inputs) of sample ``i`` (module docstring)."""
        s = self.seq_length
        tokens = np.full(s + 1, self.options.pad, dtype=np.int64)
        weights = np.zeros(s, dtype=np.float32)
        bounds, o = [], 0
        for doc, n in self.conversations(int(i)):
            tokens[o:o + n] = self.indexed.get(doc, 0, n)
            weights[o:o + n - 1] = self.masks.get(doc, 1, n - 1)  # label t + 1 of input t, same conversation
            bounds.append(o)
            o += n
        if o < s:
            bounds.append(o)  # the padding, a document of its own
        return tokens, weights, (*bounds, s)
