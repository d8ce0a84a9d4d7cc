"""Blends: greedy mix tracks the weights at every prefix, weights by size, shared-vocabulary check."""

import numpy as np
import pytest

from ptdp.data import (
    BlendedDataset,
    ByteTokenizer,
    DataError,
    IndexedDatasetWriter,
    build_datasets,
    get_microbatch,
)
from ptdp.data.blended_dataset import greedy_blend_indices


def write_corpus(prefix: str, texts: list[str]) -> None:
    writer = IndexedDatasetWriter(prefix, ByteTokenizer.vocab_size)
    for text in texts:
        writer.add_document(ByteTokenizer().encode(text) + [ByteTokenizer.eod_id])
    writer.finalize()


@pytest.fixture
def two_corpora(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_corpus(a, [f"aaaa {k} " * 40 for k in range(40)])  # lowercase 'a' only in A
    write_corpus(b, [f"BBBB {k} " * 30 for k in range(90)])  # uppercase 'B' only in B
    return a, b


def source(sample: np.ndarray) -> str:
    return "a" if ord("a") in sample else "b" if ord("B") in sample else "?"


def test_weighted_blend_within_two_percent_at_every_prefix(two_corpora):
    a, b = two_corpora
    train = build_datasets(["0.3", a, "0.7", b], "1,0,0", 16, seed=0).train
    assert isinstance(train, BlendedDataset)
    sources = [source(train[i]) for i in range(1000)]
    assert "?" not in sources
    from_a = np.cumsum([s == "a" for s in sources])
    n = np.arange(1, 1001)
    assert abs(from_a[-1] / 1000 - 0.3) < 0.02
    assert np.all(
        np.abs(from_a[49:] / n[49:] - 0.3) < 0.02
    )  # the mix holds at every step, not just on average


def test_greedy_indices_reference():
    d, s = greedy_blend_indices([1, 1], 6)
    assert d.tolist() == [0, 1, 0, 1, 0, 1] and s.tolist() == [0, 0, 1, 1, 2, 2]
    d, _ = greedy_blend_indices([0.2, 0.3, 0.5], 10_000)
    assert np.allclose(np.bincount(d) / 10_000, [0.2, 0.3, 0.5], atol=1e-3)
    counts = np.stack([np.cumsum(d == k) for k in range(3)])
    ideal = np.outer([0.2, 0.3, 0.5], np.arange(1, 10_001))
    assert np.abs(counts - ideal).max() < 1.0  # never more than one sample off target


def test_blend_by_size_and_epochs(two_corpora):
    a, b = two_corpora
    splits = build_datasets([a, b], "90,10,0", 16, seed=1)
    train = splits.train
    members = train.datasets
    assert len(train) == sum(len(m) for m in members)
    assert np.allclose(train.weights, [len(m) / len(train) for m in members])
    n = len(train)
    epoch0 = sorted(tuple(train[i].tolist()) for i in range(n))
    reference = sorted(tuple(m[k].tolist()) for m in members for k in range(len(m)))
    assert epoch0 == reference  # one blend epoch = exactly one epoch of every member
    assert sorted(tuple(train[n + i].tolist()) for i in range(n)) == reference
    assert [train[n + i].tolist() for i in range(20)] == [train[i].tolist() for i in range(20)]  # wraps
    again = build_datasets([a, b], "90,10,0", 16, seed=1).train
    assert all(np.array_equal(again[i], train[i]) for i in range(0, 3 * n, 7))
    batch = get_microbatch(train, 2, 8, 1, 2, 2, 1)
    assert batch.shape == (2, 17)
    assert splits.valid is not None and splits.test is None


def test_blend_rejects_mixed_vocabularies(two_corpora, tmp_path):
    a, b = two_corpora
    from ptdp.data import BPETokenizer

    BPETokenizer.train(["some text to train on"] * 10, 300).save(b + ".tokenizer.json")
    with pytest.raises(DataError, match="different tokenizer"):
        build_datasets([a, b], "1,0,0", 16, 0)
    with pytest.raises(DataError, match="pairs"):
        build_datasets(["0.5", a, "0.5"], "1,0,0", 16, 0)
