"""`ptdp preprocess`: JSONL round trip, summary counts, BPE training, malformed lines, --strict, errors."""

import json
import subprocess
import sys

import numpy as np
import pytest

from ptdp.data import BPETokenizer, ByteTokenizer, IndexedDataset, build_datasets, load_tokenizer
from ptdp.data.preprocess import main

TEXTS = [f"def f{k}(x):\n    return x * {k}  # naïve ✓\n" * (k % 4 + 1) for k in range(300)]


def write_jsonl(path, texts, bad_lines=()):
    with open(path, "w", encoding="utf-8") as f:
        for k, text in enumerate(texts):
            if k in bad_lines:
                f.write(bad_lines[k] + "\n")
            f.write(json.dumps({"text": text, "id": k}) + "\n")
    return str(path)


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("workers", [1, 2])
def test_byte_round_trip_and_summary(tmp_path, capsys, workers):
    src = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    prefix = str(tmp_path / "out")
    code, out, _ = run_cli(capsys, "--input", src, "--output-prefix", prefix, "--workers", str(workers))
    assert code == 0
    summary = json.loads(out.strip().splitlines()[-1])
    tok = ByteTokenizer()
    stream = np.asarray([i for t in TEXTS for i in tok.encode(t) + [tok.eod_id]], dtype=np.int64)
    assert summary["documents"] == len(TEXTS) and summary["tokens"] == len(stream)
    assert summary["output_prefix"] == prefix and summary["malformed"] == 0
    indexed = IndexedDataset(prefix)
    assert indexed.dtype == np.uint16 and np.array_equal(indexed.tokens[:], stream)
    assert isinstance(load_tokenizer(prefix), ByteTokenizer)
    train = build_datasets([prefix], "1,0,0", 32, seed=0).train
    docs = np.concatenate([indexed.document(int(k)) for k in train.document_index]).astype(np.int64)
    got = sorted(tuple(train[i].tolist()) for i in range(len(train)))
    assert got == sorted(tuple(docs[j * 32 : j * 32 + 33].tolist()) for j in range(len(train)))


def test_bpe_trains_and_round_trips(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    prefix = str(tmp_path / "bpe")
    code, out, _ = run_cli(
        capsys,
        "--input",
        src,
        "--output-prefix",
        prefix,
        "--tokenizer",
        "bpe",
        "--vocab-size",
        "400",
        "--workers",
        "2",
    )
    assert code == 0
    summary = json.loads(out.strip().splitlines()[-1])
    tok = load_tokenizer(prefix)
    assert isinstance(tok, BPETokenizer) and tok.vocab_size == 400 == summary["vocab_size"]
    assert tok.decode([tok.eod_id]) == "" and tok.encode("<|endoftext|>") != []
    indexed = IndexedDataset(prefix)
    assert summary["documents"] == indexed.num_documents == len(TEXTS)
    assert summary["tokens"] == indexed.num_tokens < sum(len(t.encode()) for t in TEXTS)  # BPE compresses
    for k in (0, 5, 299):
        doc = indexed.document(k).tolist()
        assert doc[-1] == tok.eod_id and doc[:-1] == tok.encode(TEXTS[k])
        assert tok.decode(doc) == TEXTS[k]
    assert tok.decode(tok.encode("unseen ∑ text 😀")) == "unseen ∑ text 😀"
    assert build_datasets([prefix], "1,0,0", 16, 0).tokenizer.fingerprint == tok.fingerprint
    # Re-running with bytes over the same prefix must not leave the BPE tokenizer behind.
    assert run_cli(capsys, "--input", src, "--output-prefix", prefix)[0] == 0
    assert isinstance(load_tokenizer(prefix), ByteTokenizer)


def test_malformed_lines_counted(tmp_path, capsys):
    bad = {3: "{not json", 10: '["a list"]', 20: '{"text": 5}', 30: '{"other": "x"}'}
    src = write_jsonl(tmp_path / "in.jsonl", TEXTS[:50], bad_lines=bad)
    with open(src, "a") as f:
        f.write("\n")  # blank lines are skipped, not malformed
    code, out, err = run_cli(capsys, "--input", src, "--output-prefix", str(tmp_path / "o"), "--workers", "2")
    summary = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and summary["malformed"] == 4 and summary["documents"] == 50
    assert summary["first_malformed"] == f"{src}:4" and "skipped 4 malformed" in err


def _cli(args, tmp_path):
    return subprocess.run(
        [sys.executable, "-m", "ptdp.data.preprocess", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_strict_fails_with_one_line(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "in.jsonl", TEXTS[:50], bad_lines={7: "{oops"})
    proc = _cli(
        ["--input", src, "--output-prefix", str(tmp_path / "o"), "--strict", "--tokenizer", tokenizer],
        tmp_path,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and f"{src}:8: malformed line" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.glob("o.*"))  # nothing half-written


def test_missing_input_and_bad_flags(tmp_path):
    proc = _cli(
        ["--input", str(tmp_path / "missing.jsonl"), "--output-prefix", str(tmp_path / "o")], tmp_path
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--input: cannot read" in proc.stderr
    src = write_jsonl(tmp_path / "in.jsonl", TEXTS[:5])
    proc = _cli(["--input", src, "--output-prefix", str(tmp_path / "o"), "--vocab-size", "500"], tmp_path)
    assert proc.returncode == 2 and "--vocab-size" in proc.stderr and proc.stderr.count("\n") == 1
    proc = _cli(
        ["--input", src, "--output-prefix", str(tmp_path / "o"), "--tokenizer", "bpe", "--vocab-size", "100"],
        tmp_path,
    )
    assert proc.returncode == 2 and "--vocab-size 100" in proc.stderr and "Traceback" not in proc.stderr


def test_tokenizer_file_shares_vocab_for_blends(tmp_path, capsys):
    first = write_jsonl(tmp_path / "a.jsonl", TEXTS[:150])
    second = write_jsonl(tmp_path / "b.jsonl", TEXTS[150:])
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert (
        run_cli(capsys, "--input", first, "--output-prefix", a, "--tokenizer", "bpe", "--vocab-size", "300")[
            0
        ]
        == 0
    )
    code, out, _ = run_cli(
        capsys,
        "--input",
        second,
        "--output-prefix",
        b,
        "--tokenizer",
        "bpe",
        "--tokenizer-file",
        a + ".tokenizer.json",
    )
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["vocab_size"] == 300
    tok = load_tokenizer(a)
    assert IndexedDataset(b).document(0).tolist() == tok.encode(TEXTS[150]) + [tok.eod_id]
    splits = build_datasets(["0.5", a, "0.5", b], "1,0,0", 16, 0)
    assert splits.tokenizer.fingerprint == load_tokenizer(b).fingerprint and len(splits.train) > 0


POOL_UNDER_A_SIGTERM_HANDLER = """
import signal
from ptdp.data.inputs import fork_pool
signal.signal(signal.SIGTERM, lambda signum, frame: None)
pool = fork_pool(2, dict, ())
print(pool.apply(signal.getsignal, (signal.SIGTERM,)) == signal.SIG_DFL, flush=True)
pool.terminate()
pool.join()
"""


def test_pool_workers_take_sigterms_default_action_whatever_the_caller_handles():
    """``Pool.terminate`` stops a worker still waiting for the task queue's lock (which ``terminate`` takes
    and keeps) by SIGTERM alone. A worker forked from a process whose Python SIGTERM handler returns would
    inherit it, wait for that lock forever, and ``terminate`` with it: the preprocessor's workers start with
    SIGTERM's default action whatever the caller handles."""
    try:
        proc = subprocess.run([sys.executable, "-c", POOL_UNDER_A_SIGTERM_HANDLER], capture_output=True, text=True,
                              timeout=120)
    except subprocess.TimeoutExpired as err:
        raise AssertionError("the pool did not stop") from err
    assert proc.stdout == "True\n", proc.stdout + proc.stderr[-2000:]
