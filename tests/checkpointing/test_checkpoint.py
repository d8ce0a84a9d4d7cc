"""Checkpoints: exact resume, resharding between layouts, atomic and verified saves, a killed worker,
SIGTERM, and one clear line for every bad input. All runs are real ``ptdp train`` processes."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import (
    TINY,
    Run,
    assert_equivalent,
    assert_same_run,
    assert_same_training,
    initial_full_state,
    losses,
    refused_in_process,
    run_layouts,
    run_ptdp,
    track,
    train_metrics,
)

from ptdp.checkpointing import CheckpointError, read_full_model_state, read_latest, write_full_model_state
from ptdp.checkpointing.validation import checkpoint_errors
from ptdp.config import Config, ModelConfig, config_from_args
from ptdp.models import GPTModel
from ptdp.parallel.init import init_parameters

RTOL = 1e-4  # another layout sums in another order: fp32 tolerance
SIX = [*TINY, "--train-iters", "6"]  # the later --train-iters wins
EIGHT_LAYERS = [*SIX, "--num-layers", "8"]  # so that p x v = 4 x 2 splits it


def run(args: list[str], env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m ptdp ARGS`` with extra environment variables; never hangs (timeout fails the test)."""
    return run_ptdp(args, timeout=timeout, check=False, env=env)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line and "worker(s) failed" not in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


T2 = ["--tensor-model-parallel-size", "2"]


def write_initial_full_model(path: Path) -> dict:
    """``write_full_model_state`` of the one-process initial weights (an imported model); returns them."""
    cfg = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, hidden_dropout=0.0,
                      attention_dropout=0.0)
    model = GPTModel(cfg, 257, cfg.padded_vocab_size(257, 1))
    init_parameters(model, 1234, cfg.init_method_std, cfg.num_layers)
    full = {name: p.detach() for name, p in model.named_parameters()}
    full["embedding.word_embeddings.weight"] = full["embedding.word_embeddings.weight"][:257]  # unpadded ok
    write_full_model_state(path, full, {"model": {**vars(cfg), "vocab_size": 257}})
    return full


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every run that needs no launcher, fault or signal, in ONE spawn of 4 processes (``run_layouts``;
    starting Python and torch costs far more than these runs): six straight iterations in one process and
    at t=2; a t=2 run stopped by --exit-interval 3 that saved a checkpoint, resumed in place and at t=1; an
    imported full model trained at t=2; and an 8-layer (t,p,d) = (2,2,1) save resumed in other pipeline
    layouts."""
    tmp = tmp_path_factory.mktemp("runs")
    t2_ckpt, pipe_ckpt, imported = tmp / "t2-ckpt", str(tmp / "pipe-ckpt"), tmp / "imported"
    full = write_initial_full_model(imported)
    runs = run_layouts(tmp, {
        "reference": (1, SIX),
        "t2-straight": (2, [*SIX, *T2]),
        "t2-first": (2, [*SIX, *T2, "--save", str(t2_ckpt), "--exit-interval", "3"]),
        "t2-resumed": (2, [*SIX, *T2, "--load", str(t2_ckpt)]),
        "t1-resumed": (1, [*SIX, "--load", str(t2_ckpt)]),
        "t2-imported": (2, [*SIX, *T2, "--load", str(imported)]),
        "pipe-reference": (1, EIGHT_LAYERS),
        "t2p2-save": (4, [*EIGHT_LAYERS, *T2, "--pipeline-model-parallel-size", "2", "--save", pipe_ckpt,
                          "--exit-interval", "3"]),
        "p4v2": (4, [*EIGHT_LAYERS, "--pipeline-model-parallel-size", "4", "--virtual-pipeline-model-parallel-size",
                     "2", "--load", pipe_ckpt]),
        "p2d2-distopt": (4, [*EIGHT_LAYERS, "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                             "--load", pipe_ckpt]),  # d=2 shards Adam
    }, base=[], save={"reference", "t1-resumed", "pipe-reference", "p4v2", "p2d2-distopt"})  # weights compared
    return {**runs, "t2-ckpt": t2_ckpt, "imported": imported, "full": full}


@pytest.fixture(scope="module")
def reference(runs) -> Run:
    """Six iterations in one process, never interrupted (losses, gradient norms, final weights)."""
    return runs["reference"]


@pytest.fixture(scope="module")
def t2(runs) -> dict:
    """t=2: six straight iterations (loss, gradient norm), and a run stopped by --exit-interval 3 that saved
    a checkpoint."""
    return {"straight": track(runs["t2-straight"].records), "first": runs["t2-first"].records,
            "ckpt": runs["t2-ckpt"]}


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> dict:
    """One process saving every 3 iterations, killed in the middle of saving iteration 6."""
    tmp = tmp_path_factory.mktemp("crash")
    ckpt, metrics = tmp / "ckpt", tmp / "first.jsonl"
    proc = run(["train", *SIX, "--save", str(ckpt), "--save-interval", "3", "--metrics-file", str(metrics)],
               env={"PTDP_TEST_CRASH_IN_SAVE": "6"})
    return {"proc": proc, "ckpt": ckpt, "first": records(metrics), "tmp": tmp}


def test_resume_in_place_is_bit_identical(t2, runs):
    assert [r["iteration"] for r in t2["first"]] == [1, 2, 3]
    assert read_latest(t2["ckpt"]) == 3 and (t2["ckpt"] / "iter_0000003" / "checksums.sha256").is_file()
    resumed = runs["t2-resumed"].records
    assert [r["iteration"] for r in resumed] == [4, 5, 6]
    assert track(t2["first"]) + track(resumed) == t2["straight"]  # bit for bit
    # Loading never modifies the checkpoint (two runs loaded it): nothing added, every file as saved.
    iter3 = t2["ckpt"] / "iter_0000003"
    saved = {name: digest for digest, name in (line.split("  ", 1) for line in
                                                (iter3 / "checksums.sha256").read_text().splitlines())}
    assert sorted(p.name for p in t2["ckpt"].iterdir()) == ["iter_0000003", "latest"]
    assert {str(p.relative_to(iter3)) for p in iter3.rglob("*")} == {*saved, "checksums.sha256"}
    assert {name: hashlib.sha256((iter3 / name).read_bytes()).hexdigest() for name in saved} == saved


def test_resume_in_another_tensor_layout(runs, reference):
    """t=2 -> one process (t -> d moves are covered by the pipeline test's (2,2,1) -> (1,2,2))."""
    resumed = runs["t1-resumed"]
    assert [r["iteration"] for r in resumed.records] == [4, 5, 6]
    assert_equivalent(resumed, reference, RTOL)


def test_full_model_state_is_the_same_in_every_layout(t2, crashed):
    sharded, config = read_full_model_state(t2["ckpt"])
    single, _ = read_full_model_state(crashed["ckpt"] / "iter_0000003")
    assert sharded.keys() == single.keys()
    assert sharded["layers.0.attention.qkv.weight"].shape == (3, 32, 32)
    assert_same_training(sharded, single, initial_full_state(single, config))  # fp32 order, not elementwise
    assert config["model"]["hidden_size"] == 32 and config["model"]["vocab_size"] == 257
    assert config["parallel"]["tensor_model_parallel_size"] == 2


def test_pipeline_checkpoint_loads_in_other_pipeline_layouts(runs):
    """(t,p,d) = (2,2,1) saves; (1,4,1) with v=2 and (1,2,2) with the distributed optimizer resume with the
    uninterrupted run."""
    assert [r["iteration"] for r in runs["t2p2-save"].records] == [1, 2, 3]
    assert_same_run(runs["t2p2-save"], runs["pipe-reference"], RTOL)
    for name in ("p4v2", "p2d2-distopt"):
        assert [r["iteration"] for r in runs[name].records] == [4, 5, 6]
        assert_equivalent(runs[name], runs["pipe-reference"], RTOL)


def test_interrupted_save_keeps_the_previous_checkpoint(crashed, reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(crashed["ckpt"], ckpt)  # others read the crashed checkpoint too
    assert crashed["proc"].returncode == 17
    assert [r["iteration"] for r in crashed["first"]] == list(range(1, 7))
    assert read_latest(ckpt) == 3 and (ckpt / ".tmp-iter_0000006").is_dir()  # the half-written save
    assert not (ckpt / "iter_0000006").exists()
    resumed = train_metrics(tmp_path, 1, ["--load", str(ckpt), "--save", str(ckpt), "--keep-last", "1"], base=SIX)
    assert losses(resumed) == reference.losses[3:]  # same layout: bit for bit
    assert read_latest(ckpt) == 6 and not (ckpt / ".tmp-iter_0000006").exists()
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000006"]


def test_killed_worker_is_restarted_and_finishes_with_the_same_losses(t2, tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    proc = run(["train", *SIX, "--tensor-model-parallel-size", "2", "--nproc-per-node", "2", "--max-restarts", "1",
                "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2", "--keep-last", "2",
                "--metrics-file", str(metrics)], env={"PTDP_TEST_KILL_AT_ITERATION": "5"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ptdp train: worker rank 1 killed by SIGKILL; restarting every worker from the latest checkpoint " \
           "(restart 1 of 1)" in proc.stderr  # rank 1 really died, and the launcher says so in one line
    got = {r["iteration"]: (r["loss"], r["grad_norm"]) for r in records(metrics)}  # the restart logs 5 and 6
    assert [got[i] for i in range(1, 7)] == t2["straight"]
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000004", "iter_0000006"]


def test_sigterm_saves_then_exits_cleanly(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    proc = run(["train", *SIX, "--nproc-per-node", "2", "--save", str(ckpt), "--metrics-file", str(metrics)],
               env={"PTDP_TEST_KILL_AT_ITERATION": "3:TERM"})  # SIGTERM to rank 1 only
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["iteration"] for r in records(metrics)] == [1, 2, 3]
    assert read_latest(ckpt) == 3
    tensors, _ = read_full_model_state(ckpt)  # a d=2 save is a complete, verified checkpoint
    assert all(torch.isfinite(t).all() for t in tensors.values())


def _copy_iteration_3(crashed, tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(crashed["ckpt"] / "iter_0000003", ckpt / "iter_0000003")
    (ckpt / "latest").write_text("3\n")
    return ckpt


def test_corrupted_checkpoint_file_is_named(crashed, tmp_path):
    ckpt = _copy_iteration_3(crashed, tmp_path)
    victim = ckpt / "iter_0000003" / "__0_0.distcp"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40  # one flipped bit
    victim.write_bytes(bytes(data))
    proc = run(["train", *SIX, "--nproc-per-node", "2", "--load", str(ckpt)], timeout=180)
    assert_one_line_error(proc, str(victim), "corrupted or truncated")
    assert proc.returncode == 2


@pytest.mark.parametrize("victim", [".metadata", "ptdp.json", "__0_0.distcp"])
def test_truncated_or_missing_file_is_named(crashed, tmp_path, victim):
    ckpt = _copy_iteration_3(crashed, tmp_path)
    path = ckpt / "iter_0000003" / victim
    path.write_bytes(path.read_bytes()[:100])
    assert checkpoint_errors(_config("--load", str(ckpt)), 1) == [
        f"--load: checkpoint file {path} is corrupted or truncated (sha256 mismatch); restore it or point "
        f"{ckpt / 'latest'} at an older checkpoint"]
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        read_full_model_state(ckpt)
    path.unlink()
    assert "is missing" in checkpoint_errors(_config("--load", str(ckpt)), 1)[0]


def test_nan_loss_stops_without_saving_over_the_last_good_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = run(["train", *SIX, "--lr", "1e30", "--min-lr", "0", "--save", str(ckpt), "--save-interval", "1"])
    assert_one_line_error(proc, "loss is nan at iteration 2")
    assert proc.returncode == 2 and read_latest(ckpt) == 1
    tensors, _ = read_full_model_state(ckpt)
    assert all(torch.isfinite(t).all() for t in tensors.values())


def _config(*flags: str) -> Config:
    from ptdp.cli.main import build_parser

    return config_from_args(build_parser().parse_args(["train", *SIX, *flags]))


@pytest.mark.parametrize("flags", [
    ["--load", "MISSING", "--nproc-per-node", "2"],  # rejected by the launcher, before any worker starts
    ["--load", "CKPT", "--hidden-size", "64"],  # rejected by the worker itself
])
def test_bad_checkpoint_input_is_one_line_without_traceback(crashed, tmp_path, flags, capsys):
    ckpt = crashed["ckpt"]
    before = tree_digest(ckpt)
    flags = [{"MISSING": str(tmp_path / "missing"), "CKPT": str(ckpt)}.get(f, f) for f in flags]
    proc = refused_in_process(["train", *SIX, *flags], capsys)
    line = assert_one_line_error(proc, "--load")
    assert proc.returncode == 2 and ("does not exist" in line or "--hidden-size 32 there, 64 here" in line)
    assert tree_digest(ckpt) == before  # a rejected load touches nothing


def test_a_load_refused_inside_training_gives_sigterm_back(monkeypatch, capsys):
    """``train`` takes SIGTERM over for the job (a graceful stop at the next iteration); a job refused while
    loading, past the checks that run before it, must give the calling process its own handling back: a
    handler left behind would swallow every later SIGTERM to that process."""
    from ptdp.checkpointing import CheckpointManager
    from ptdp.config import ConfigError

    def refuse(self):
        raise ConfigError("--load: the checkpoint was refused while loading")

    monkeypatch.setattr(CheckpointManager, "resume", refuse)
    sigterm = signal.getsignal(signal.SIGTERM)
    proc = refused_in_process(["train", *SIX], capsys)
    assert_one_line_error(proc, "refused while loading")
    assert proc.returncode == 2
    assert signal.getsignal(signal.SIGTERM) is sigterm


def test_each_bad_checkpoint_flag_names_itself(crashed, tmp_path):
    ckpt = str(crashed["ckpt"])
    (tmp_path / "file").write_text("")
    cases = {
        ("--load", str(tmp_path / "missing")): "--load {} does not exist".format(tmp_path / "missing"),
        ("--load", str(tmp_path / "file")): "is not a directory",
        ("--save", str(tmp_path / "file" / "sub")): "--save {} is not a directory".format(tmp_path / "file" / "sub"),
        ("--load", ckpt, "--seq-length", "32"): "--seq-length 16 there, 32 here",
        ("--load", ckpt, "--num-layers", "2", "--ffn-hidden-size", "64"): "--num-layers 4 there, 2 here; "
                                                                          "--ffn-hidden-size 128 there, 64 here",
        ("--load", ckpt, "--vocab-size", "300"): "--vocab-size 257 there, 300 here",
        ("--load", ckpt, "--make-vocab-size-divisible-by", "100"): "--make-vocab-size-divisible-by 100",
        ("--save-interval", "2"): "--save-interval needs --save DIR",
        ("--keep-last", "0", "--save", ckpt): "--keep-last must be a positive integer",
    }
    for flags, fragment in cases.items():
        errors = checkpoint_errors(_config(*flags), 1)
        assert len(errors) == 1 and fragment in errors[0], (flags, errors)
    bad_latest = tmp_path / "bad"
    bad_latest.mkdir()
    (bad_latest / "latest").write_text("seven")
    assert "should hold an iteration number" in checkpoint_errors(_config("--load", str(bad_latest)), 1)[0]
    (bad_latest / "latest").write_text("7")
    assert "iter_0000007 does not exist" in checkpoint_errors(_config("--load", str(bad_latest)), 1)[0]
    # Nothing saved yet means "start fresh": an empty --load directory, or --load = --save not created yet.
    assert checkpoint_errors(_config("--load", str(tmp_path)), 1) == []
    fresh = str(tmp_path / "new")
    assert checkpoint_errors(_config("--load", fresh, "--save", fresh), 1) == []


def test_imported_full_model_trains_like_a_fresh_start(t2, runs):
    """write_full_model_state of the initial weights, loaded at t=2, gives the fresh t=2 run's losses."""
    back, config = read_full_model_state(runs["imported"])
    full = runs["full"]
    assert back.keys() == full.keys() and config["model"]["vocab_size"] == 257
    torch.testing.assert_close(back["embedding.word_embeddings.weight"][:257], full["embedding.word_embeddings.weight"])
    assert track(runs["t2-imported"].records) == t2["straight"]
