"""Every file input is checked by ``ptdp train``'s launcher before any worker starts, and a
problem is ONE line on stderr with exit 2: no worker started (none touched its marker), nothing from
torchrun (``Sending process ... closing signal SIGTERM``, ``failed (exitcode: 2)``) or the launcher beside
it. A worker's own error (found only once training runs: a NaN loss) is one line too.

Four workers, as in the reference command; the launcher refuses before starting them, so each refusal
runs in the test's own process (``helpers.refused_in_process``, with ``tests/faults`` on PYTHONPATH as a
real run has it, so a worker the launcher did start would touch its marker all the same)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import FAULTS, TINY, refused_in_process, run_ptdp, train_run

from ptdp.data.indexed_dataset import IndexedDatasetWriter

FOUR = ["--nproc-per-node", "4"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A checkpoint (one process, one iteration) and a small dataset; the tests damage copies of them."""
    root = tmp_path_factory.mktemp("inputs")
    train_run(root, 1, ["--train-iters", "1", "--save", str(root / "ck")])
    writer = IndexedDatasetWriter(str(root / "corpus"), vocab_size=257)
    for k in range(64):
        writer.add_document(list(range(k % 7, 200)))
    writer.finalize()
    return {"ck": root / "ck", "corpus": root / "corpus"}


def _corrupt_checkpoint(files: dict, tmp_path: Path) -> list[str]:
    ck = tmp_path / "ck"
    shutil.copytree(files["ck"], ck)
    data = next(ck.glob("iter_*/*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped bit pattern in the middle: sizes unchanged, only the hash tells
    data.write_bytes(bytes(raw))
    return ["--load", str(ck)]


def _truncated_index(files: dict, tmp_path: Path) -> list[str]:
    for suffix in (".bin", ".idx"):
        shutil.copy(f"{files['corpus']}{suffix}", tmp_path / f"corpus{suffix}")
    idx = tmp_path / "corpus.idx"
    idx.write_bytes(idx.read_bytes()[:-8])
    return ["--data-path", str(tmp_path / "corpus")]


def _missing_bin(files: dict, tmp_path: Path) -> list[str]:
    shutil.copy(f"{files['corpus']}.idx", tmp_path / "corpus.idx")
    return ["--data-path", "0.5", str(files["corpus"]), "0.5", str(tmp_path / "corpus")]


def _bad_config(files: dict, tmp_path: Path) -> list[str]:
    (tmp_path / "run.toml").write_text("[training\ntrain_iters = 3\n")
    return ["--config", str(tmp_path / "run.toml")]


CASES = {  # name: (the flags, given the module's files and this test's tmp_path; what the line must say)
    "missing data": (lambda f, t: ["--data-path", "missing/corpus"],
                     "ptdp train: error: --data-path: cannot read missing/corpus.bin (No such file or directory)"),
    "missing .bin of a blend": (_missing_bin, "corpus.bin (No such file or directory)"),
    "truncated index": (_truncated_index, "corpus.idx is"),
    "missing tokenizer model": (lambda f, t: ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                              str(t / "tok")], "--tokenizer-model: no tokenizer at"),
    "missing vocabulary file": (lambda f, t: ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                                              str(t / "vocab.json"), "--merge-file", str(t / "merges.txt")],
                                "--vocab-file: GPT2BPETokenizer needs a readable file"),
    "missing --load": (lambda f, t: ["--load", str(t / "nowhere")], "does not exist"),
    "corrupted checkpoint": (_corrupt_checkpoint, "is corrupted or truncated (sha256 mismatch)"),
    "missing --config": (lambda f, t: ["--config", str(t / "missing.toml")], "--config"),
    "broken --config": (_bad_config, "run.toml"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_file_input_is_one_line_before_any_worker_starts(files, tmp_path, case, monkeypatch, capfd):
    flags, expected = CASES[case]
    markers = tmp_path / "workers"
    markers.mkdir()
    monkeypatch.setenv("PTDP_TEST_WORKER_MARKER", str(markers))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(FAULTS), os.environ.get("PYTHONPATH")) if p))
    proc = refused_in_process(["train", *TINY, *FOUR, *flags(files, tmp_path)], capfd)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ptdp train: error: "), proc.stderr[-3000:]
    assert expected in lines[0], lines[0]
    assert not list(markers.iterdir()), "a worker started"


def test_a_workers_own_error_is_one_line_with_nothing_from_the_launcher(tmp_path):
    """A NaN loss is found by the workers while they train: rank 0's line alone reaches the terminal."""
    metrics = tmp_path / "m.jsonl"
    proc = run_ptdp(["train", *TINY, "--nproc-per-node", "2", "--train-iters", "4", "--lr", "1e30",
                     "--lr-warmup-iters", "0", "--metrics-file", str(metrics)], check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        "ptdp train: error: the loss is nan at iteration 2; stopped without saving (the last checkpoint is kept); "
        "lower --lr, raise --lr-warmup-iters or set --clip-grad"], proc.stderr[-3000:]
    assert [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()] == [1, 2]
