"""GPT samples over a range of documents, Megatron-style.

The split's documents are concatenated (each already ends in eod) into one token stream; sample ``j`` is
``stream[j*s : j*s + s + 1]`` (``s`` = seq_length), i.e. fixed windows at stride ``s`` that run across
document boundaries and overlap by one token so inputs ``[:-1]`` and labels ``[1:]`` come from one array.
Documents are written back to back in ``.bin``, so a document range is one contiguous memmap slice and a
sample is a single slice: no per-rank int64 copy of the corpus ever exists.

Sample order is shuffled per epoch: index ``i`` belongs to epoch ``e = i // len`` and reads window
``perm_e[i % len]``, where ``perm_e`` comes from ``numpy.random.default_rng([seed, salt, e])``. The order
is therefore a pure function of (seed, i), which is what makes resumption exact (see microbatch.py).
"""

from __future__ import annotations

import numpy as np

from ptdp.data.indexed_dataset import IndexedDataset


class GPTDataset:
    def __init__(
        self,
        indexed: IndexedDataset,
        document_range: tuple[int, int],
        seq_length: int,
        seed: int,
        salt: int = 0,
    ) -> None:
        """``salt`` separates the shuffles of datasets sharing a seed (train/valid/test, blend members)."""
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        self.indexed = indexed
        self.document_range = (int(document_range[0]), int(document_range[1]))
        self.seq_length = seq_length
        self.seed = seed
        self.salt = salt
        self.token_start = int(indexed.offsets[self.document_range[0]])
        self.num_tokens = int(indexed.offsets[self.document_range[1]]) - self.token_start
        self._num_samples = max(0, (self.num_tokens - 1) // seq_length)
        self._perms: dict[int, np.ndarray] = {}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_perms"] = {}  # recomputed on demand; keeps DataLoader-worker pickles small
        return state

    def __len__(self) -> int:
        return self._num_samples

    def permutation(self, epoch: int) -> np.ndarray:
        """Sample order of ``epoch``; the two most recent are kept, enough for a batch spanning a boundary."""
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, self.salt, epoch]).permutation(self._num_samples)
            if len(self._perms) >= 2:
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = perm
        return perm

    def window(self, j: int) -> np.ndarray:
        """Unshuffled sample ``j`` (``0 <= j < len``) as int64."""
        start = self.token_start + j * self.seq_length
        return self.indexed.tokens[start : start + self.seq_length + 1].astype(np.int64)

    def __getitem__(self, i: int) -> np.ndarray:
        i = int(i)
        if i < 0 or self._num_samples == 0:
            raise IndexError(f"sample index {i} out of range for a dataset of {self._num_samples} samples")
        epoch, local = divmod(i, self._num_samples)
        return self.window(int(self.permutation(epoch)[local]))
