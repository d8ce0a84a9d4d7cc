"""Ctrl-C (SIGINT) on real ``ptdp train`` runs: a graceful stop that saves at the stopped iteration, one
line, exit 130, no traceback on any rank, and a run resumed from it continues with the losses of an
uninterrupted one; a second Ctrl-C stops at once and leaves the previous checkpoint the one loaded.

The signal goes to the launcher's process group, as a terminal's Ctrl-C does (torchrun's workers run in
sessions of their own, so the terminal reaches the launcher alone)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TINY, finish_command, losses, run_ptdp, start_command, worker_env

from ptdp.checkpointing import read_full_model_state, read_latest

ITERS = 20  # the runs are stopped after iteration 3, long before this
LONG = [*TINY, "--train-iters", str(ITERS)]


def start(args: list[str]) -> subprocess.Popen:
    return start_command([sys.executable, "-m", "ptdp", "train", *args], worker_env())


def wait_for_line(proc: subprocess.Popen, pattern: str, timeout: float = 240) -> list[str]:
    """stdout lines up to the first matching ``pattern`` (the run is killed and the test fails on timeout)."""
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if re.search(pattern, line):
            return lines
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"no line matching {pattern!r}:\n{''.join(lines)}\n{proc.stderr.read()[-3000:]}")


def finish(proc: subprocess.Popen, seen: list[str], timeout: float = 120) -> tuple[int, str, str]:
    """Exit code, all stdout (the lines already read first) and stderr; a hung run is killed (helpers)."""
    done = finish_command(proc, timeout)
    return done.returncode, "".join(seen) + done.stdout, done.stderr


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def interrupt_after_iteration_3(tmp_path: Path, nproc: int) -> dict:
    ckpt, metrics = tmp_path / "ck", tmp_path / "first.jsonl"
    launch = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
    proc = start([*LONG, *launch, "--save", str(ckpt), "--metrics-file", str(metrics)])
    seen = wait_for_line(proc, r"iteration\s+3/")
    os.killpg(proc.pid, signal.SIGINT)
    code, out, err = finish(proc, seen)
    return {"code": code, "out": out, "err": err, "ckpt": ckpt, "first": records(metrics)}


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> list[float]:
    """The losses of an uninterrupted run, in one process: what an interrupted and resumed run must log
    (d = 2 sums in another order: relative 1e-7, far inside the comparison's 1e-5)."""
    metrics = tmp_path_factory.mktemp("straight") / "straight.jsonl"
    run_ptdp(["train", *LONG, "--metrics-file", str(metrics)])
    return losses(records(metrics))


@pytest.mark.parametrize("nproc", [2, 1])
def test_ctrl_c_saves_at_the_stopped_iteration_and_resumes_exactly(tmp_path, nproc, straight):
    run = interrupt_after_iteration_3(tmp_path, nproc)
    assert run["code"] == 130, run["err"][-3000:]
    assert "Traceback" not in run["err"] + run["out"], run["err"][-3000:]
    stopped = [line for line in run["err"].splitlines() if line.startswith("ptdp train: stopped at iteration")]
    assert len(stopped) == 1, run["err"]
    n = int(re.search(r"stopped at iteration (\d+);", stopped[0]).group(1))
    assert 3 <= n < ITERS
    assert stopped[0] == f"ptdp train: stopped at iteration {n}; saved to {run['ckpt'] / f'iter_{n:07d}'}"
    assert [r["iteration"] for r in run["first"]] == list(range(1, n + 1))
    # The checkpoint on disk is whole: latest names it, every checksum verifies, nothing temporary is left.
    assert read_latest(run["ckpt"]) == n
    read_full_model_state(run["ckpt"])
    assert not list(run["ckpt"].glob(".tmp-*"))
    # No heartbeat is left behind, inside the checkpoint directory or in the run directory beside it.
    assert not (run["ckpt"] / "hang").exists() and not Path(f"{run['ckpt']}.run").exists()
    if nproc > 1:  # the launcher's first line, before anything slow
        assert run["out"].startswith("ptdp train: 2 worker(s), layout t=1 p=1 d=2: checking"), run["out"][:300]

    launch = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
    resumed = tmp_path / "resumed.jsonl"
    run_ptdp(["train", *LONG, *launch, "--load", str(run["ckpt"]), "--metrics-file", str(resumed)])
    got = losses(run["first"]) + losses(records(resumed))
    assert len(got) == ITERS
    if nproc == 1:
        assert got == straight  # the same layout: bit for bit
    assert got == pytest.approx(straight, rel=1e-5)


def test_second_ctrl_c_during_the_save_stops_at_once_and_the_previous_checkpoint_loads(tmp_path):
    ckpt = tmp_path / "ck"
    # A wider model than TINY, so the save lasts long enough to be interrupted in the middle.
    args = [*LONG, "--hidden-size", "256", "--save", str(ckpt), "--save-interval", "2"]
    proc = start([*args, "--nproc-per-node", "2"])
    seen = wait_for_line(proc, r"iteration\s+3/")
    assert read_latest(ckpt) == 2
    os.killpg(proc.pid, signal.SIGINT)
    deadline = time.monotonic() + 60
    while not list(ckpt.glob(".tmp-iter_*")) and time.monotonic() < deadline:
        time.sleep(0.002)
    assert list(ckpt.glob(".tmp-iter_*")), "the save of the stopped iteration never started"
    os.killpg(proc.pid, signal.SIGINT)
    code, out, err = finish(proc, seen)
    assert code == 130, err[-3000:]
    assert "Traceback" not in err + out, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("ptdp train: stopped")]
    assert len(lines) == 1 and lines[0].startswith("ptdp train: stopped at once in iteration "), err
    assert lines[0].endswith(f"nothing saved since iteration 2 ({ckpt / 'iter_0000002'})"), lines[0]
    assert read_latest(ckpt) == 2  # the interrupted save never moved latest
    read_full_model_state(ckpt)

    # The next start removes the half-written directory and resumes from iteration 2.
    proc = run_ptdp(["train", *args, "--load", str(ckpt), "--train-iters", "3"])
    assert "removed " in proc.stdout and "left by an interrupted save" in proc.stdout, proc.stdout
    assert f"loaded checkpoint {ckpt} at iteration 2" in proc.stdout
    assert not list(ckpt.glob(".tmp-*"))


def test_ctrl_c_without_save_says_nothing_was_saved(tmp_path):
    proc = start([*LONG])
    seen = wait_for_line(proc, r"iteration\s+3/")
    os.killpg(proc.pid, signal.SIGINT)
    code, out, err = finish(proc, seen)
    assert code == 130, err[-3000:]
    assert "Traceback" not in err + out
    assert re.search(r"^ptdp train: stopped at iteration \d+; nothing saved \(no --save\)$", err, re.M), err


def test_ctrl_c_during_start_up_stops_at_once(tmp_path):
    """SIGINT right after the launcher's first line: the launcher or the still-starting workers stop at once,
    with one line, nothing saved, no traceback (whichever process the signal finds first)."""
    ckpt = tmp_path / "ck"
    proc = start([*LONG, "--nproc-per-node", "2", "--save", str(ckpt)])
    seen = wait_for_line(proc, r"^ptdp train: 2 worker")
    os.killpg(proc.pid, signal.SIGINT)
    code, out, err = finish(proc, seen)
    assert code == 130, err[-3000:]
    assert "Traceback" not in err + out, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("ptdp train: stopped")]
    assert lines == ["ptdp train: stopped at once during start-up; nothing saved"], err
    assert not list(ckpt.glob("iter_*")) and read_latest(ckpt) is None
