"""Core data contract: indexed files, GPT samples, epochs, get_microbatch layout/resume, default corpus."""

import os

import numpy as np
import pytest
import torch

from ptdp.data import (
    ByteTokenizer,
    DataError,
    GPTDataset,
    IndexedDataset,
    IndexedDatasetWriter,
    build_datasets,
    default_corpus_prefix,
    dtype_for_vocab,
    get_microbatch,
)
from ptdp.data.builder import split_document_ranges

TEXTS = [f"document {k}: " + "héllo wörld " * (k % 7 + 1) + "x" * k for k in range(60)]


def write_corpus(prefix: str, texts=TEXTS) -> np.ndarray:
    """Write ``texts`` byte-tokenized; return the reference token stream (with eod after each doc)."""
    tok = ByteTokenizer()
    writer = IndexedDatasetWriter(prefix, tok.vocab_size)
    stream = []
    for text in texts:
        ids = tok.encode(text) + [tok.eod_id]
        writer.add_document(ids)
        stream.extend(ids)
    writer.finalize()
    return np.asarray(stream, dtype=np.int64)


def megatron_windows(dataset) -> list[tuple]:
    """Every sample Megatron's order can give: windows at stride s of the documents in document-index order."""
    s = dataset.seq_length
    stream = np.concatenate([dataset.indexed.document(int(k)) for k in dataset.document_index]).astype(np.int64)
    return sorted(tuple(stream[j * s : j * s + s + 1].tolist()) for j in range(len(dataset)))


@pytest.fixture
def corpus(tmp_path):
    prefix = str(tmp_path / "corpus")
    return prefix, write_corpus(prefix)


def test_indexed_round_trip_and_dtype(corpus, tmp_path):
    prefix, stream = corpus
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16 and ds.num_documents == len(TEXTS) and ds.num_tokens == len(stream)
    tok = ByteTokenizer()
    for k in (0, 17, 59):
        assert ds.document(k).tolist() == tok.encode(TEXTS[k]) + [256]
        assert tok.decode(ds.document(k)) == TEXTS[k]
    # A vocabulary beyond uint16 switches the file to int32 and keeps large ids intact.
    assert dtype_for_vocab(65536) == np.uint16 and dtype_for_vocab(65537) == np.int32
    big = str(tmp_path / "big")
    writer = IndexedDatasetWriter(big, vocab_size=70_000)
    writer.add_document([69_999, 65_536, 3])
    writer.finalize()
    assert IndexedDataset(big).dtype == np.int32
    assert IndexedDataset(big).document(0).tolist() == [69_999, 65_536, 3]
    assert os.path.getsize(big + ".bin") == 12
    assert not [p for p in os.listdir(tmp_path) if ".tmp." in p]  # temp files were renamed away


def test_samples_are_stride_windows_of_the_stream(corpus):
    prefix, stream = corpus
    s = 16
    splits = build_datasets([prefix], "1,0,0", seq_length=s, seed=3)
    train = splits.train
    assert splits.valid is None and splits.test is None
    assert len(train) == (len(stream) - 1) // s
    got = sorted(tuple(train[i].tolist()) for i in range(len(train)))
    assert got == megatron_windows(train)
    assert sorted(train.document_index.tolist()) == list(range(len(TEXTS)))  # one epoch, documents shuffled
    assert all(train[i].dtype == np.int64 and train[i].shape == (s + 1,) for i in range(3))
    # Shuffled: the first epoch is not the identity order.
    assert [train[i].tolist() for i in range(5)] != [stream[j * s : j * s + s + 1].tolist() for j in range(5)]


def test_split_by_document_ranges(corpus):
    prefix, stream = corpus
    ranges = split_document_ranges(60, [0.8, 0.15, 0.05])
    assert ranges == [(0, 48), (48, 57), (57, 60)]
    splits = build_datasets([prefix], "80,15,5", seq_length=8, seed=0)
    ds = IndexedDataset(prefix)
    for dataset, (lo, hi) in zip((splits.train, splits.valid, splits.test), ranges):
        part = stream[int(ds.offsets[lo]) : int(ds.offsets[hi])]
        assert len(dataset) == (len(part) - 1) // 8
        assert sorted(dataset.document_index.tolist()) == list(range(lo, hi))
        assert sorted(tuple(dataset[i].tolist()) for i in range(len(dataset))) == megatron_windows(dataset)


def test_epochs_wrap_deterministically(corpus):
    prefix, _ = corpus
    n = len(build_datasets([prefix], "1,0,0", 16, seed=7).train)
    a = build_datasets([prefix], "1,0,0", 16, seed=7, num_samples=(2 * n, None, None)).train
    b = build_datasets([prefix], "1,0,0", 16, seed=7, num_samples=(2 * n, None, None)).train
    assert len(a) >= 2 * n and len(a.document_index) == 2 * len(TEXTS)  # two epochs of documents
    order = [a[i].tolist() for i in range(len(a))]
    assert order[:n] != order[n : 2 * n]
    assert [b[i].tolist() for i in range(len(a) - 1, -1, -1)] == order[::-1]  # pure function of (seed, i)
    assert [a[len(a) + i].tolist() for i in range(3)] == order[:3]  # past the end: wraps
    c = build_datasets([prefix], "1,0,0", 16, seed=8, num_samples=(2 * n, None, None)).train
    assert [c[i].tolist() for i in range(n)] != order[:n]


@pytest.mark.parametrize("dp_size,micro", [(1, 1), (1, 4), (2, 1), (2, 2), (4, 1), (4, 3)])
def test_microbatch_union_matches_single_process(corpus, dp_size, micro):
    prefix, _ = corpus
    ds = build_datasets([prefix], "1,0,0", 16, seed=1).train
    B = 12 if micro == 3 else 8
    for iteration in (0, 3, 40):  # 40 * B runs past one epoch
        reference = get_microbatch(ds, iteration, B, 0, 1, B, 0)
        rows = [
            get_microbatch(ds, iteration, B, r, dp_size, micro, j)
            for r in range(dp_size)
            for j in range(B // (dp_size * micro))
        ]
        assert all(x.dtype == torch.int64 and x.shape == (micro, 17) for x in rows)
        assert torch.equal(torch.cat(rows), reference)


def test_resume_is_exact(corpus):
    prefix, _ = corpus
    run = build_datasets([prefix], "1,0,0", 16, seed=5).train
    seen = {k: get_microbatch(run, k, 8, 1, 2, 2, 1) for k in range(30)}
    resumed = build_datasets([prefix], "1,0,0", 16, seed=5).train  # fresh process state, start at k=17
    for k in range(17, 30):
        assert torch.equal(get_microbatch(resumed, k, 8, 1, 2, 2, 1), seen[k])


def test_bad_layout_and_paths(tmp_path, corpus):
    prefix, _ = corpus
    ds = build_datasets([prefix], "1,0,0", 16, seed=5).train
    with pytest.raises(ValueError, match="divisible"):
        get_microbatch(ds, 0, 8, 0, 3, 1, 0)
    with pytest.raises(ValueError, match="microbatch 4"):
        get_microbatch(ds, 0, 8, 0, 2, 1, 4)
    missing = str(tmp_path / "nope")
    with pytest.raises(DataError) as err:
        build_datasets([missing], "969,30,1", 16, 0)
    assert str(err.value) == f"--data-path: cannot read {missing}.bin (No such file or directory)"
    os.remove(prefix + ".bin")
    with pytest.raises(DataError, match=r"cannot read .*corpus\.bin"):
        build_datasets([prefix], "969,30,1", 16, 0)
    with open(prefix + ".bin", "wb") as f:
        f.write(b"\0" * 10)  # truncated / foreign .bin
    with pytest.raises(DataError, match="truncated or mismatched"):
        build_datasets([prefix], "969,30,1", 16, 0)
    with pytest.raises(DataError, match="--split"):
        build_datasets(None, "a,b", 16, 0)


def test_default_corpus_builds_deterministic_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("PTDP_CACHE_DIR", str(tmp_path / "cache"))
    prefix = default_corpus_prefix()
    assert os.path.dirname(prefix) == str(tmp_path / "cache")
    mtime = os.stat(prefix + ".bin").st_mtime_ns
    assert default_corpus_prefix() == prefix and os.stat(prefix + ".bin").st_mtime_ns == mtime  # cached
    rebuilt = default_corpus_prefix(str(tmp_path / "other"))  # independent rebuild, same bytes
    for suffix in (".bin", ".idx"):
        with open(prefix + suffix, "rb") as f1, open(rebuilt + suffix, "rb") as f2:
            assert f1.read() == f2.read()
    indexed = IndexedDataset(prefix)
    assert indexed.num_documents > 100 and indexed.num_tokens > 1_000_000
    ends = indexed.tokens[np.asarray(indexed.offsets[1:]) - 1]
    assert (ends == 256).all() and int((indexed.tokens[:] == 256).sum()) == indexed.num_documents
    splits = build_datasets(None, "969,30,1", 64, seed=0)
    assert isinstance(splits.tokenizer, ByteTokenizer) and isinstance(splits.train, GPTDataset)
    assert splits.valid is not None and len(splits.train) > 10 * len(splits.valid)
    batch = get_microbatch(splits.train, 0, 4, 0, 1, 4, 0)
    assert batch.shape == (4, 65) and int(batch.max()) <= 256


def test_pickle_is_small_and_equivalent(corpus):
    import pickle

    prefix, stream = corpus
    train = build_datasets([prefix], "1,0,0", 64, seed=2).train
    before = [train[i] for i in range(0, 3 * len(train), 5)]
    blob = pickle.dumps(train)
    assert len(blob) < stream.nbytes // 4  # the token stream is reopened, not copied (the indices are O(samples))
    clone = pickle.loads(blob)
    assert all(np.array_equal(a, clone[i]) for a, i in zip(before, range(0, 3 * len(train), 5)))


def test_concurrent_default_corpus_builds_are_safe(tmp_path):
    """Ranks starting at once may all build the cache; each must end up reading one complete file."""
    import subprocess
    import sys

    code = (
        "from ptdp.data import IndexedDataset, default_corpus_prefix\n"
        "p = default_corpus_prefix()\n"
        "d = IndexedDataset(p)\n"
        "print(p, d.num_documents, d.num_tokens, int(d.tokens[-1]))\n"
    )
    env = {**os.environ, "PTDP_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(3)
    ]
    try:
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [err.decode() for _, err in outputs]
    lines = {out.decode() for out, _ in outputs}
    assert len(lines) == 1 and lines.pop().split()[-1] == "256"
    assert (
        sorted(os.listdir(tmp_path / "cache"))[0].endswith(".bin")
        and len(os.listdir(tmp_path / "cache")) == 2
    )
