"""A weighted mix of datasets that tracks the weights at every prefix of the sample stream.

Megatron's greedy rule (``build_blending_indices`` in helpers.cpp): sample ``i`` goes to the dataset that
is most under-sampled so far, ``argmax_d (w_d * max(i, 1) - count_d)``. Every prefix of the stream is then within
about one sample per dataset of the target mix, so short runs see the intended blend too, and the
assignment is deterministic (no RNG). One blend epoch has ``sum(len(d))`` samples; index ``i`` in epoch
``e`` reads sample ``e * count_d + k`` of its dataset, so members advance into their own next epoch
(a fresh shuffle) exactly as they run out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ptdp.data.gpt_dataset import GPTDataset


def greedy_blend_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset index, sample index within that dataset) for each of ``size`` positions."""
    w = [float(x) for x in weights]
    total = sum(w)
    w = [x / total for x in w]
    counts = [0] * len(w)
    dataset_index = np.empty(size, dtype=np.int32)
    sample_index = np.empty(size, dtype=np.int64)
    others = range(1, len(w))
    for i in range(size):  # O(size * len(w)) in pure Python: ~1 s per million samples for two datasets
        target = max(i, 1)
        d, best = 0, w[0] * target - counts[0]
        for k in others:  # ties go to the lowest index, as in Megatron
            err = w[k] * target - counts[k]
            if err > best:
                d, best = k, err
        dataset_index[i] = d
        sample_index[i] = counts[d]
        counts[d] += 1
    return dataset_index, sample_index


def blend_weights(weights: Sequence[float]) -> np.ndarray:
    """The normalized weights a blend's index is built from (one function, so that an index built ahead of
    its ``BlendedDataset`` holds the very same floats, and ties break the same way)."""
    return np.asarray(weights, dtype=np.float64) / float(np.sum(weights))


class BlendedDataset:
    """Same interface as :class:`GPTDataset`: ``len`` is one epoch, any ``i >= 0`` is valid."""

    def __init__(
        self, datasets: Sequence[GPTDataset], weights: Sequence[float], size: int | None = None,
        indices: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """``indices``: ``greedy_blend_indices(weights, size)`` when the caller already built it."""
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("BlendedDataset needs one weight per dataset")
        self.datasets = list(datasets)
        self.weights = blend_weights(weights)
        self.seq_length = datasets[0].seq_length
        self._size = int(size if size is not None else sum(len(d) for d in datasets))
        self.dataset_index, self.sample_index = indices or greedy_blend_indices(self.weights, self._size)
        self.counts = np.bincount(self.dataset_index, minlength=len(datasets))

    def __len__(self) -> int:
        return self._size

    def locate(self, i: int) -> tuple[GPTDataset, int]:
        """(member dataset, sample index in it) of blended sample ``i`` (``ptdp samples`` reads this too)."""
        i = int(i)
        if i < 0 or self._size == 0:
            raise IndexError(f"sample index {i} out of range for a blend of {self._size} samples")
        epoch, local = divmod(i, self._size)
        d = int(self.dataset_index[local])
        return self.datasets[d], epoch * int(self.counts[d]) + int(self.sample_index[local])

    def __getitem__(self, i: int) -> np.ndarray:
        dataset, k = self.locate(i)
        return dataset[k]
