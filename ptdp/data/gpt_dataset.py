"""GPT samples over a range of sequences in Megatron-LM's GPTDataset order (same seed -> same batches).

Megatron's algorithm (``megatron/core/datasets/gpt_dataset.py`` and ``helpers.cpp``), reproduced exactly:

1. **Epochs.** ``num_epochs`` is the smallest ``e`` with ``e * tokens_per_epoch >= num_samples * s + 1``.
   With more than one epoch the last is shuffled on its own when it is needed for less than 80% of an
   epoch's samples ("separate final epoch").
2. **Document index.** The split's sequence ids repeated ``num_epochs`` times (as int32) and shuffled by
   ``numpy.random.RandomState(seed)``; with a separate final epoch, the first ``e - 1`` epochs and the last
   one are shuffled separately, in that order, by the same RandomState.
3. **Sample index.** Sample ``i`` starts at token ``i * s`` of the document index's token stream and spans
   ``s + 1`` tokens (crossing document boundaries); ``sample_index[i] = (position in document index,
   offset in that document)``; ``(num_epochs * tokens_per_epoch - 1) // s`` samples.
4. **Shuffle index.** ``arange(samples)`` shuffled by the same RandomState (the pre-final-epoch samples and
   the rest separately when the final epoch is separate). Sample ``i`` of the dataset reads
   ``shuffle_index[i]``.

Steps 3 is the C++ loop of ``build_sample_idx`` vectorised (a ``searchsorted`` over document starts); the
tests compare it with a literal transcription of the loop. ``--data-cache-path`` stores the three arrays
as ``.npy`` files keyed by a hash of everything they depend on, so later runs (and ``ptdp samples``) memory-
map them instead of rebuilding. Indices past the end wrap around (Megatron would fail; ptdp asks for
enough samples up front, so only extra evaluation passes wrap).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid

import numpy as np

from ptdp.data.indexed_dataset import IndexedDataset
from ptdp.observability.flight_recorder import announce

SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def num_epochs_for(tokens_per_epoch: int, seq_length: int, num_samples: int | None) -> int:
    if num_samples is None or tokens_per_epoch <= 0:
        return 1
    requested = num_samples * seq_length + 1
    return max(1, -(-requested // tokens_per_epoch))


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(
    sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int, num_epochs: int,
    tokens_per_epoch: int,
) -> np.ndarray:
    """``[num_samples + 1, 2]`` (document-index position, offset) of token ``i * s`` (helpers.cpp)."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    lengths = np.asarray(sequence_lengths)[document_index].astype(np.int64)
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc = np.searchsorted(starts[1:], positions, side="right")  # skips empty documents, as the loop does
    out = np.empty((num_samples + 1, 2), dtype=np.int64)
    out[:, 0] = doc
    out[:, 1] = positions - starts[doc]
    return out


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_indices(
    sequence_lengths: np.ndarray, documents: np.ndarray, seq_length: int, seed: int, num_samples: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document_index, sample_index, shuffle_index) exactly as Megatron's GPTDataset builds them."""
    tokens_per_epoch = int(np.asarray(sequence_lengths)[documents].astype(np.int64).sum())
    num_epochs = num_epochs_for(tokens_per_epoch, seq_length, num_samples)
    separate = False
    if num_epochs > 1:
        sans_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        from_final = num_samples - sans_final
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate = from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate)
    sample_index = build_sample_index(sequence_lengths, document_index, seq_length, num_epochs, tokens_per_epoch)
    total = sample_index.shape[0] - 1
    shuffle_index = build_shuffle_index(sans_final if separate else total, total, rng)
    return document_index, sample_index, shuffle_index


def _cached(cache_path: str | None, description: dict, build) -> tuple[np.ndarray, ...]:
    """Load the three arrays from ``cache_path`` (memory-mapped) or build them and save them atomically."""
    if not cache_path:
        with announce(f"building the {description['split']} sample index"):  # no rank waiting for it is hung
            return build()
    digest = hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()
    names = ("document_index", "sample_index", "shuffle_index")
    paths = [os.path.join(cache_path, f"{digest}-GPTDataset-{description['split']}-{n}.npy") for n in names]
    if all(os.path.exists(p) for p in paths):
        return tuple(np.load(p, mmap_mode="r") for p in paths)
    with announce(f"building the {description['split']} sample index"):
        arrays = build()
    os.makedirs(cache_path, exist_ok=True)
    for path, array in zip(paths, arrays):  # several ranks may race: each publishes a whole file
        tmp = f"{path}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}.npy"
        np.save(tmp, array)
        os.replace(tmp, path)
    return arrays


class GPTDataset:
    """Samples of ``seq_length + 1`` tokens (inputs ``[:-1]``, labels ``[1:]``) over sequences
    ``document_range`` of ``indexed``; ``num_samples`` (None: one epoch) sets the epochs as in Megatron."""

    def __init__(
        self,
        indexed: IndexedDataset,
        document_range: tuple[int, int],
        seq_length: int,
        seed: int,
        num_samples: int | None = None,
        cache_path: str | None = None,
        split: str = "train",
    ) -> None:
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        self.indexed = indexed
        self.document_range = (int(document_range[0]), int(document_range[1]))
        self.seq_length = seq_length
        self.seed = seed
        self.num_samples = num_samples
        documents = np.arange(*self.document_range, dtype=np.int32)
        lengths = indexed.sequence_lengths
        self.tokens_per_epoch = int(lengths[self.document_range[0]:self.document_range[1]].astype(np.int64).sum())
        if self.tokens_per_epoch <= 1:  # not even one sample: an empty dataset, never indexed
            self.document_index = np.zeros(0, np.int32)
            self.sample_index = np.zeros((1, 2), np.int64)
            self.shuffle_index = np.zeros(0, np.int64)
            return
        description = {
            "prefix": os.path.abspath(indexed.prefix), "idx_size": os.path.getsize(indexed.prefix + ".idx"),
            "range": list(self.document_range), "seq_length": seq_length, "seed": seed,
            "num_samples": num_samples, "split": split,
        }
        self.document_index, self.sample_index, self.shuffle_index = _cached(
            cache_path, description, lambda: build_indices(lengths, documents, seq_length, seed, num_samples)
        )

    def __len__(self) -> int:
        return int(self.sample_index.shape[0] - 1)

    def _parts(self, i: int) -> list[tuple[int, int, int]]:
        """(sequence id, offset, length) pieces of sample ``i`` (wrapping past the end)."""
        n = len(self)
        if i < 0 or n == 0:
            raise IndexError(f"sample index {i} out of range for a dataset of {n} samples")
        j = int(self.shuffle_index[i % n])
        (beg, beg_off), (end, end_off) = self.sample_index[j], self.sample_index[j + 1]
        beg, beg_off, end, end_off = int(beg), int(beg_off), int(end), int(end_off)
        lengths = self.indexed.sequence_lengths
        parts = []
        for k in range(beg, end + 1):
            doc = int(self.document_index[k])
            start = beg_off if k == beg else 0
            stop = end_off + 1 if k == end else int(lengths[doc])
            parts.append((doc, start, stop - start))
        return parts

    def locate(self, i: int) -> tuple[GPTDataset, int]:
        """(dataset, sample index in it) of sample ``i``: this one (a blend or the train stream names a member)."""
        return self, int(i)

    def document_ids(self, i: int) -> list[int]:
        """The sequence (document) ids sample ``i`` reads from, in order."""
        return [doc for doc, _, length in self._parts(int(i)) if length > 0]

    def __getitem__(self, i: int) -> np.ndarray:
        pieces = [self.indexed.get(doc, off, length) for doc, off, length in self._parts(int(i))]
        return np.concatenate(pieces).astype(np.int64)
