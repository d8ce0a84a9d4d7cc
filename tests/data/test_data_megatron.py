"""Megatron compatibility: the MMIDIDX format against a reference writer/reader written from the field list,
GPTDataset and blend indices against a literal transcription of Megatron's algorithm, inputs, bad input."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
from helpers import TINY, refused_in_process, run_ptdp, train_metrics

from ptdp.data import IndexedDataset, build_datasets

DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}


# --- reference MMIDIDX writer / reader, from the field list of the format (not ptdp's code) -----------------
def reference_write(prefix: str, documents: list[list[list[int]]], code: int = 8) -> None:
    """``documents``: each a list of sequences (Megatron splits documents into sentences when asked)."""
    dtype = np.dtype(DTYPES[code])
    lengths, pointers, doc_idx, pointer = [], [], [0], 0
    with open(prefix + ".bin", "wb") as f:
        for doc in documents:
            for seq in doc:
                f.write(np.asarray(seq, dtype=dtype).tobytes())
                lengths.append(len(seq))
                pointers.append(pointer)
                pointer += len(seq) * dtype.itemsize
            doc_idx.append(len(lengths))
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(np.asarray(lengths, np.int32).tobytes())
        f.write(np.asarray(pointers, np.int64).tobytes())
        f.write(np.asarray(doc_idx, np.int64).tobytes())


def reference_read(prefix: str) -> list[list[int]]:
    with open(prefix + ".idx", "rb") as f:
        assert f.read(9) == b"MMIDIDX\x00\x00"
        (version,) = struct.unpack("<Q", f.read(8))
        (code,) = struct.unpack("<B", f.read(1))
        (n,) = struct.unpack("<Q", f.read(8))
        (k,) = struct.unpack("<Q", f.read(8))
        lengths = np.frombuffer(f.read(4 * n), np.int32)
        pointers = np.frombuffer(f.read(8 * n), np.int64)
        docs = np.frombuffer(f.read(8 * k), np.int64)
        assert version == 1 and f.read() == b"" and docs[0] == 0 and docs[-1] == n
    data = open(prefix + ".bin", "rb").read()
    dtype = np.dtype(DTYPES[code])
    return [np.frombuffer(data, dtype, count=int(ln), offset=int(p)).tolist() for ln, p in zip(lengths, pointers)]


# --- Megatron's GPTDataset / BlendedDataset index algorithm, transcribed loop for loop -----------------------
def megatron_indices(sizes, documents, seq_length, seed, num_samples):
    tokens_per_epoch = int(np.sum(sizes[documents]))
    num_epochs, num_tokens = 1, tokens_per_epoch
    while num_tokens < num_samples * seq_length + 1:
        num_epochs += 1
        num_tokens += tokens_per_epoch
    separate = False
    if num_epochs > 1:
        sans_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate = num_samples - sans_final < int(0.80 * per_epoch)
    rng = np.random.RandomState(seed)

    def doc_index(epochs, separate_final):
        if not separate_final or epochs == 1:
            idx = np.mgrid[0:epochs, 0 : len(documents)][1]
            idx[:] = documents
            idx = idx.reshape(-1).astype(np.int32)
            rng.shuffle(idx)
            return idx
        return np.concatenate((doc_index(epochs - 1, False), doc_index(1, False)))

    document_index = doc_index(num_epochs, separate)
    n = (num_epochs * tokens_per_epoch - 1) // seq_length  # helpers.cpp build_sample_idx, drop last partial
    sample_idx = [(0, 0)]
    d, offset = 0, 0
    while len(sample_idx) <= n:
        remaining = seq_length + 1
        while remaining != 0:
            length = sizes[document_index[d]] - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                if d == len(document_index) - 1:
                    offset = sizes[document_index[d]] - 1
                    break
                d += 1
                offset = 0
        sample_idx.append((d, offset))
    total = len(sample_idx) - 1
    first = np.arange(sans_final if separate else total, dtype=np.uint32)
    rng.shuffle(first)
    if len(first) < total:
        last = np.arange(len(first), total, dtype=np.uint32)
        rng.shuffle(last)
        first = np.concatenate((first, last))
    return document_index, np.asarray(sample_idx), first


def megatron_sample(tokens_of, document_index, sample_idx, shuffle, i, seq_length):
    j = shuffle[i]
    (b, bo), (e, eo) = sample_idx[j], sample_idx[j + 1]
    if b == e:
        return tokens_of(document_index[b])[bo : eo + 1]
    parts = [tokens_of(document_index[b])[bo:]]
    parts += [tokens_of(document_index[k]) for k in range(b + 1, e)]
    parts.append(tokens_of(document_index[e])[: eo + 1])
    return [t for p in parts for t in p]


def megatron_blend(weights, size):
    weights = np.asarray(weights, float) / np.sum(weights)
    counts = [0] * len(weights)
    out = []
    for i in range(size):
        x = max(float(i), 1.0)
        errors = [w * x - c for w, c in zip(weights, counts)]
        k = int(np.argmax(errors))  # first maximum, as the strict '>' loop
        out.append((k, counts[k]))
        counts[k] += 1
    return out


def random_corpus(prefix, seed, n_docs=40, vocab=300):
    rng = np.random.default_rng(seed)
    docs = [[rng.integers(0, vocab - 1, size=int(rng.integers(1, 60))).tolist() + [vocab - 1]] for _ in range(n_docs)]
    reference_write(prefix, docs)
    return [seq for doc in docs for seq in doc]


def test_reference_written_files_read_token_exact(tmp_path):
    docs = [[[1, 2, 3], [70000, 5]], [[9]], [[-3, 7, 8, 100000]]]  # multi-sentence documents, int32 ids
    reference_write(str(tmp_path / "m"), docs, code=4)
    ds = IndexedDataset(str(tmp_path / "m"))
    assert ds.dtype == np.int32 and ds.num_documents == 4  # sequences are the unit, as in Megatron
    assert [ds.document(k).tolist() for k in range(4)] == [s for d in docs for s in d]
    assert ds.sequence_lengths.tolist() == [3, 2, 1, 4]


def test_preprocess_output_parses_with_the_reference_reader(tmp_path):
    texts = ["hello world", "", "ünïcode ✓", "x" * 500]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    run_ptdp(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "o")])
    assert reference_read(str(tmp_path / "o")) == [list(t.encode()) + [256] for t in texts]


@pytest.mark.parametrize("seed", [1234, 7])
@pytest.mark.parametrize("epochs", [0.5, 2.3, 3.9])  # one epoch, a separate final epoch, a joined one
def test_indices_equal_megatrons_algorithm(tmp_path, seed, epochs):
    prefix = str(tmp_path / "a")
    seqs = random_corpus(prefix, seed)
    sizes = np.asarray([len(s) for s in seqs], np.int32)
    s = 16
    per_epoch = (int(sizes[:39].sum()) - 1) // s  # the train split of 969,30,1 over 40 documents: 39 of them
    num_samples = int(epochs * per_epoch)
    train = build_datasets([prefix], "969,30,1", s, seed, num_samples=(num_samples, None, None)).train
    doc, sample, shuffle = megatron_indices(sizes, np.arange(39, dtype=np.int32), s, seed, num_samples)
    assert np.array_equal(train.document_index, doc)
    assert np.array_equal(train.sample_index, sample)
    assert np.array_equal(train.shuffle_index, shuffle)
    for i in range(0, len(train), max(1, len(train) // 50)):
        assert train[i].tolist() == megatron_sample(lambda k: seqs[k], doc, sample, shuffle, i, s)


@pytest.mark.parametrize("seed", [1234, 7])
def test_blend_of_two_equals_megatrons_algorithm(tmp_path, seed):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    seqs = {a: random_corpus(a, 1), b: random_corpus(b, 2, n_docs=25)}
    s, target, weights = 8, 300, [0.3, 0.7]
    train = build_datasets(["0.3", a, "0.7", b], "969,30,1", s, seed, num_samples=(target, None, None)).train
    members = []
    for prefix, w in zip((a, b), weights):
        sizes = np.asarray([len(x) for x in seqs[prefix]], np.int32)
        n_train = round(0.969 * len(sizes)) - (round(0.969 * len(sizes)) + round(0.03 * len(sizes))
                                               + round(0.001 * len(sizes)) - len(sizes))
        want = int(math.ceil(math.ceil(target * w) * 1.005))
        members.append((prefix, megatron_indices(sizes, np.arange(n_train, dtype=np.int32), s, seed, want)))
    for i, (k, j) in enumerate(megatron_blend(weights, target)):
        prefix, (doc, sample, shuffle) = members[k]
        assert train[i].tolist() == megatron_sample(seqs[prefix].__getitem__, doc, sample, shuffle, j, s), i


def test_cache_path_saves_and_reuses_the_indices(tmp_path):
    prefix = str(tmp_path / "a")
    random_corpus(prefix, 0)
    cache = tmp_path / "cache"
    first = build_datasets([prefix], "1,0,0", 8, 3, num_samples=(500, None, None), cache_path=str(cache)).train
    assert len(list(cache.glob("*-GPTDataset-train-*.npy"))) == 3
    again = build_datasets([prefix], "1,0,0", 8, 3, num_samples=(500, None, None), cache_path=str(cache)).train
    assert isinstance(again.shuffle_index, np.memmap) and np.array_equal(again.shuffle_index, first.shuffle_index)


def test_parquet_arrow_and_datasets_dir_inputs(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = [f"row {k} " * (k % 5 + 1) for k in range(300)]
    table = pa.table({"content": texts, "other": list(range(300))})
    pq.write_table(table, tmp_path / "in.parquet", row_group_size=64)
    ds_dir = tmp_path / "saved"
    ds_dir.mkdir()
    with pa.OSFile(str(ds_dir / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=50)
    (ds_dir / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    want = [list(t.encode()) + [256] for t in texts]
    for name, source in (("p", tmp_path / "in.parquet"), ("d", ds_dir)):
        run_ptdp(["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / name), "--json-keys",
                  "content", "--workers", "2", "--progress-interval", "0"])
        assert reference_read(str(tmp_path / name)) == want


def test_bad_inputs_are_one_line_exit_2_and_write_nothing(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "in.parquet")
    (tmp_path / "empty_tok").mkdir()
    (tmp_path / "in.jsonl").write_text('{"text": "hi"}\n')
    cases = [
        (["--input", str(tmp_path / "in.parquet")], "column 'text' is not in"),
        (["--input", str(tmp_path / "in.jsonl"), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
          str(tmp_path / "empty_tok")], "no tokenizer at"),
    ]
    for args, fragment in cases:
        proc = refused_in_process(["preprocess", *args, "--output-prefix", str(tmp_path / "out")], capsys)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and fragment in proc.stderr, proc.stderr
        assert not list(tmp_path.glob("out*"))

    seqs = [[[1, 2, 3, 4]] * 3]
    broken = {"trunc": lambda p: open(p + ".bin", "r+b").truncate(6),
              "counts": lambda p: open(p + ".idx", "ab").write(b"\0" * 8),
              "dtype": lambda p: _patch(p + ".idx", 17, bytes([9]))}
    messages = {"trunc": "truncated or mismatched", "counts": "counts", "dtype": "unknown dtype code 9"}
    for name, damage in broken.items():
        prefix = str(tmp_path / name)
        reference_write(prefix, seqs)
        damage(prefix)
        with pytest.raises(Exception, match=messages[name]) as err:
            IndexedDataset(prefix)
        assert prefix in str(err.value) and "\n" not in str(err.value)
    proc = refused_in_process(["train", *TINY, "--data-path", str(tmp_path / "trunc")], capsys)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "trunc.bin" in proc.stderr


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_llama_tokenizer_directory_in_preprocess_and_train(tmp_path):
    from test_hf_llama import llama_style_tokenizer

    tok_dir = tmp_path / "llama_tok"
    tok_dir.mkdir()
    llama_style_tokenizer(tok_dir / "tokenizer.json")
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": f"def f{k}(x):\n    return x * {k}\n"}) + "\n"
                                               for k in range(300)))
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tok_dir)]
    run_ptdp(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "d"), *flags])
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    assert reference_read(str(tmp_path / "d"))[0] == [1, *hf.encode("def f0(x):\n    return x * 0\n",
                                                                   add_special_tokens=False).ids, 2]
    records = train_metrics(tmp_path, 1, [*flags, "--data-path", str(tmp_path / "d"), "--train-iters", "2"])
    assert len(records) == 2 and all(math.isfinite(r["loss"]) for r in records)


def test_gpt2_bpe_and_null_tokenizer_flags(tmp_path):
    from ptdp.data import BPETokenizer, DataError
    from ptdp.data.tokenizer_flags import build_tokenizer

    trained = BPETokenizer.train([f"the quick fox {k} jumps" for k in range(100)], 300)
    vocab, merges = trained._tok.model.save(str(tmp_path))  # GPT-2's vocab.json + merges.txt layout
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert gpt2.encode("the quick fox 7") == trained.encode("the quick fox 7")
    assert gpt2.eod_id == trained.eod_id and gpt2.decode(gpt2.encode("fox 12 jumps")) == "fox 12 jumps"
    null = build_tokenizer("NullTokenizer", vocab_size=1000)
    assert null.encode("5 17 999") == [5, 17, 999] and null.eod_id == 1000 and null.vocab_size == 1001
    for args, fragment in ((("NullTokenizer",), "--vocab-size"), (("GPT2BPETokenizer",), "--vocab-file"),
                           (("SentencePieceTokenizer",), "not supported")):
        with pytest.raises(DataError, match=fragment):
            build_tokenizer(*args)
    (tmp_path / "ids.jsonl").write_text('{"text": "1 2 3"}\n{"text": "7"}\n')
    run_ptdp(["preprocess", "--input", str(tmp_path / "ids.jsonl"), "--output-prefix", str(tmp_path / "n"),
              "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"])
    assert reference_read(str(tmp_path / "n")) == [[1, 2, 3, 1000], [7, 1000]]
    # --vocab-size N is the tokenizer's: the model holds its N ids and the end-of-document id N (Megatron's)
    run_ptdp(["train", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--data-path", str(tmp_path / "n"),
              "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "4",
              "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
              "--split", "100,0,0"])


def test_progress_is_a_bar_on_a_terminal_and_lines_in_a_log():
    import io

    from ptdp.data.progress import Progress

    log = io.StringIO()
    progress = Progress("preprocess", 4000, interval=0, stream=log, tty=False)
    progress.update(1000, documents=10, tokens=500)
    progress.update(1000, documents=10, tokens=500)
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and lines[-1].startswith("preprocess: 50.0% 2.0kB/4.0kB | 20 documents |")
    assert "tokens/s" in lines[-1] and "ETA 0:" in lines[-1] and "\r" not in log.getvalue()
    quiet = io.StringIO()
    Progress("plan", 10, unit="layouts", interval=3600, stream=quiet, tty=False).update(5)
    assert quiet.getvalue() == ""  # a short search prints nothing into a log
