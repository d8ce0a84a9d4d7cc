"""The command line a new user meets: argument parsing as Megatron-LM's, Megatron-LM's defaults, and one
clear line (exact first words, exit code, nothing written) for each common mistake."""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path

import pytest
from helpers import run_ptdp

from ptdp import __version__
from ptdp.cli.generate import TextStream
from ptdp.cli.main import build_parser
from ptdp.cli.parser import closest_flag, subparser
from ptdp.config import Config, validate
from ptdp.data import ByteTokenizer
from ptdp.runtime.phases import Phase

ONE = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
       "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1"]


def one_error(proc, first_words: str, code: int = 2) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and "usage:" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(first_words), proc.stderr
    return lines[0]


def files_in(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*"))


# --- argument parsing ------------------------------------------------------------------------------------

def test_an_abbreviated_flag_is_refused_with_the_flag_it_abbreviates():
    line = one_error(run_ptdp(["train", "--train-iter", "3"], check=False),
                     "ptdp train: error: unrecognized argument(s): --train-iter 3")
    assert line.endswith("did you mean --train-iters?")


def test_an_unknown_flag_names_the_closest_valid_one():
    train = subparser(build_parser(), "train")
    assert closest_flag("--num-layer", train) == "--num-layers"
    assert closest_flag("--tensor-parallel-size", train) == "--tensor-model-parallel-size"
    assert closest_flag("--hiden-size=3", train) == "--hidden-size"
    assert closest_flag("--zzzz", train) is None


def test_a_bad_value_is_one_line():
    one_error(run_ptdp(["train", "--train-iters", "x"], check=False),
              "ptdp train: error: argument --train-iters: invalid int value: 'x'")


def test_help_says_each_default_once():
    parser = build_parser()
    train = subparser(parser, "train")
    helps = [a.help or "" for a in train._actions]
    assert not [h for h in helps if "(default: None)" in h]
    assert not [h for h in helps if h.count("(default") > 1]
    ffn = next(a.help for a in train._actions if "--ffn-hidden-size" in a.option_strings)
    assert ffn == "MLP hidden size (default 4h)"
    beta2 = next(a.help for a in train._actions if "--adam-beta2" in a.option_strings)
    assert beta2.endswith("(default: 0.999)")
    assert all(not isinstance(p, argparse.ArgumentParser) or not p.allow_abbrev for p in (parser, train))


def test_version():
    proc = run_ptdp(["--version"])
    assert proc.stdout.startswith(f"ptdp {__version__} (torch ")


# --- defaults ---------------------------------------------------------------------------------------------

def test_megatron_defaults_and_a_bad_lr_names_lr():
    config = Config()
    assert config.optimizer.min_lr == 0.0  # Megatron-LM's
    config.optimizer.lr = 1e-5
    assert validate(config, 1) == []
    config.optimizer.lr = -1.0
    assert validate(config, 1) == ["--lr must be >= 0, got -1.0"]
    one_error(run_ptdp(["train", "--lr", "-1"], check=False), "ptdp train: error: --lr must be >= 0, got -1.0")


def test_each_evaluation_flag_is_named_alone_and_eval_iters_zero_is_valid():
    config = Config()
    config.training.eval_iters = 0  # Megatron-LM's way to turn evaluation off
    assert validate(config, 1) == []
    config.training.eval_iters = -1
    assert validate(config, 1) == ["--eval-iters must be >= 0 (0 turns evaluation off), got -1"]
    config.training.eval_iters, config.training.eval_interval = 1, 0
    assert validate(config, 1) == ["--eval-interval must be positive, got 0"]


def test_the_defaults_table_is_in_the_docs():
    text = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    assert "| flag | Megatron-LM | ptdp | why |" in text
    for flag in ("--lr-warmup-iters", "--lr-decay-style", "--weight-decay", "--log-interval", "--eval-iters"):
        assert f"`{flag}`" in text, flag


# --- --load -----------------------------------------------------------------------------------------------

def test_load_without_a_checkpoint_says_it_starts_from_scratch(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_ptdp(["train", *ONE, "--load", str(empty)])
    assert f" no checkpoint in {empty}: starting from scratch\n" in proc.stdout
    assert files_in(empty) == []


def test_exit_on_missing_checkpoint(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    one_error(run_ptdp(["train", *ONE, "--load", str(empty), "--exit-on-missing-checkpoint"], check=False),
              f"ptdp train: error: --load {empty} holds no checkpoint and --exit-on-missing-checkpoint is set")
    assert files_in(empty) == []


def test_a_megatron_checkpoint_directory_is_named_with_how_to_convert_it(tmp_path):
    megatron = tmp_path / "megatron"
    (megatron / "iter_0000010").mkdir(parents=True)
    (megatron / "latest_checkpointed_iteration.txt").write_text("10\n")
    before = files_in(megatron)
    line = one_error(run_ptdp(["train", *ONE, "--load", str(megatron)], check=False),
                     f"ptdp train: error: --load {megatron} is a Megatron-LM checkpoint")
    assert "ptdp import" in line
    assert files_in(megatron) == before


# --- preprocess -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("content, named", [
    ('{"content": "hello", "id": 1}\n{"content": "world", "id": 2}\n', "the first record has the keys 'content', 'id'"),
    ("", "holds no JSON line (the input is empty)"),
])
def test_preprocess_writing_no_document_is_an_error(tmp_path, content, named):
    source = tmp_path / "in.jsonl"
    source.write_text(content)
    out = tmp_path / "out"
    out.mkdir()
    line = one_error(run_ptdp(["preprocess", "--input", str(source), "--output-prefix", str(out / "corpus")],
                              check=False), "ptdp preprocess: error: no document written")
    assert named in line
    if content:
        assert "'text' (--json-keys)" in line
    assert files_in(out) == []


def test_preprocess_with_the_right_key_still_writes(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text('{"content": "hello"}\n')
    proc = run_ptdp(["preprocess", "--input", str(source), "--json-keys", "content", "--output-prefix",
                     str(tmp_path / "corpus")])
    assert json.loads(proc.stdout.strip().splitlines()[-1])["documents"] == 1


# --- feedback ---------------------------------------------------------------------------------------------

def test_a_text_stream_writes_exactly_the_decoded_text_piece_by_piece():
    tok = ByteTokenizer()
    text = "héllo € wörld"
    pieces: list[str] = []
    stream = TextStream(tok, pieces.append)
    for token in tok.encode(text):
        stream(token)
    stream.close()
    assert "".join(pieces) == text
    assert len(pieces) == len(text)  # one piece per character: multi-byte ones once complete
    assert not [p for p in pieces if "\ufffd" in p]


def test_a_slow_phase_is_announced_on_rank_0_and_a_quick_one_is_not(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    quick = Phase("quick step", after_s=60, rank=0)
    quick.stop()
    slow = Phase("slow step", after_s=0.01, rank=0)
    deadline = time.monotonic() + 30
    while not slow.announced and time.monotonic() < deadline:
        time.sleep(0.01)
    slow.stop()
    slow.stop()  # a second stop says nothing more
    other_rank = Phase("rank 1 step", after_s=0.0, rank=1)
    other_rank.stop()
    lines = out.getvalue().splitlines()
    assert lines[0] == " slow step..." and lines[1].startswith(" slow step: done in ")
    assert len(lines) == 2
