"""Ctrl-C (SIGINT) on real ``ptdp train`` runs, at any moment: within 5 s, ONE line on stderr saying what
happened and what was saved, exit 130, no traceback on any rank, and the latest checkpoint loads; a first
Ctrl-C during training saves at the stopped iteration and a run resumed from it continues with the losses
of an uninterrupted one; a second Ctrl-C stops at once and leaves the previous checkpoint the one loaded.

The signal goes to the launcher's process group, as a terminal's Ctrl-C does (torchrun's workers run in
sessions of their own, so the terminal reaches the launcher alone)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from helpers import TINY, losses, run_ptdp, start_command, train_metrics, worker_env

from ptdp.checkpointing import read_full_model_state, read_latest

ITERS = 20  # the graceful runs are stopped after iteration 3, long before this
LONG = [*TINY, "--train-iters", str(ITERS)]
STOP_S = 5.0  # the promise: stopped this long after the Ctrl-C at the latest


class Run:
    """A ``ptdp train`` started in a session of its own, its output read as it comes (with timestamps)."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.start = time.monotonic()
        self.proc = start_command([sys.executable, "-m", "ptdp", "train", *args], {**worker_env(), **(env or {})})
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
                         threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True)]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(re.search(pattern, line) for line in self.out):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.01)
        self.kill()
        raise AssertionError(f"no line matching {pattern!r}:\n" + "\n".join(self.out + self.err)[-3000:])

    def interrupt(self) -> float:
        os.killpg(self.proc.pid, signal.SIGINT)
        return time.monotonic()

    def finish(self, timeout: float = 120) -> tuple[int, str, str]:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        for reader in self._readers:
            reader.join(10)
        return code, "\n".join(self.out), "\n".join(self.err)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_latest_loads(ckpt: Path, line: str) -> None:
    """What the line says is on disk is what is there, and it loads (every checksum verifies)."""
    latest = read_latest(ckpt) if ckpt.exists() else None
    if latest is None:
        assert "nothing saved" in line and "since" not in line, line
        return
    assert line.endswith(f"{ckpt / f'iter_{latest:07d}'}") or line.endswith(f"({ckpt / f'iter_{latest:07d}'})"), line
    read_full_model_state(ckpt)
    assert not [p for p in ckpt.glob(".tmp-*") if p.is_dir()] or "at once" in line


# Ctrl-C at 1, 3 and 8 s after the launch of the reference command (smaller: 2 workers, p = 2), while a
# save is being written, and during a long evaluation: wherever the run is then (launch, imports,
# rendezvous, data, model build, iterations between saves, a save, an evaluation), one line within 5 s, exit
# 130, and the latest checkpoint loads.
@pytest.mark.parametrize("moment", ["1", "3", "8", "save", "evaluation"])
def test_ctrl_c_at_any_moment_stops_within_seconds_with_one_line(tmp_path, moment):
    ckpt = tmp_path / "ck"
    flags = ["--train-iters", "100000", "--log-interval", "1000"]
    env = None
    if moment == "evaluation":  # 200 validation batches of at least 0.05 s each at iteration 4: 10 s or more
        flags = ["--train-iters", "40", "--log-interval", "1", "--eval-interval", "4", "--eval-iters", "200"]
        env = {"PTDP_TEST_SLOW_RANK": "*:0.05"}
    run = Run([*TINY, *flags, "--nproc-per-node", "2", "--pipeline-model-parallel-size", "2", "--save", str(ckpt),
               "--save-interval", "3"], env)
    if moment == "evaluation":  # iteration 4 (about 0.5 s) and its evaluation follow the line of iteration 3
        run.wait_for(r"iteration\s+3/")
        time.sleep(1.5)
    elif moment == "save":  # the first Ctrl-C while a checkpoint is being written
        deadline = time.monotonic() + 240
        while not list(ckpt.glob(".tmp-iter_*")) and time.monotonic() < deadline and run.proc.poll() is None:
            time.sleep(0.002)
        assert list(ckpt.glob(".tmp-iter_*")), "no save started:\n" + "\n".join(run.out + run.err)[-3000:]
    else:  # not before the launch line: a Ctrl-C inside the launcher's own Python start-up is Python's
        run.wait_for(r"^ptdp train: ")  # (0.1 s after the start on an idle machine; seconds on a loaded one)
        time.sleep(max(0.0, float(moment) - (time.monotonic() - run.start)))
    sent = run.interrupt()
    code, out, err = run.finish()
    took = time.monotonic() - sent
    assert code == 130, err[-3000:]
    assert took <= STOP_S, f"stopped {took:.1f} s after the Ctrl-C\n{out[-2000:]}\n{err[-2000:]}"
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ptdp train: stopped "), err  # nothing else on stderr
    assert "Traceback" not in out
    assert_latest_loads(ckpt, lines[0])
    if moment in ("save", "evaluation"):  # a first Ctrl-C lets the save finish, then saves where it stops
        n = int(re.search(r"stopped at iteration (\d+); saved to", lines[0]).group(1))
        assert read_latest(ckpt) == n
    if moment == "evaluation":  # stopped in iteration 4's evaluation, cut short: no partial validation loss
        assert n == 4 and "validation loss at iteration 4" not in out, out[-2000:]


def test_ctrl_c_while_the_workers_start_python_waits_for_their_handler(tmp_path):
    """A worker still in the interpreter's own start-up would meet a SIGINT with Python's fatal error and
    its traceback: the launcher passes it on once the worker's handler is in, a moment later."""
    markers = tmp_path / "workers"
    markers.mkdir()
    run = Run([*LONG, "--nproc-per-node", "2"],
              env={"PTDP_TEST_WORKER_MARKER": str(markers), "PTDP_TEST_SLOW_WORKER_START": "2"})
    deadline = time.monotonic() + 60
    while len(list(markers.iterdir())) < 2 and time.monotonic() < deadline and run.proc.poll() is None:
        time.sleep(0.002)
    assert len(list(markers.iterdir())) == 2, "the workers never started:\n" + "\n".join(run.out + run.err)[-3000:]
    sent = run.interrupt()  # both workers sleep inside Python's start-up now
    code, out, err = run.finish()
    assert time.monotonic() - sent <= STOP_S
    assert code == 130, err[-3000:]
    assert err.startswith("ptdp train: stopped at once during start-up") and len(err.splitlines()) == 1, err


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> list[float]:
    """The losses of an uninterrupted run, in one process: what an interrupted and resumed run must log
    (d = 2 sums in another order: relative 1e-7, far inside the comparison's 1e-5). In a rank of the
    session's pool (``helpers.train_metrics``): the same ``train()`` as a ``ptdp train`` process."""
    return losses(train_metrics(tmp_path_factory.mktemp("straight"), 1, ["--train-iters", str(ITERS)]))


@pytest.mark.parametrize("nproc", [2, 1])
def test_ctrl_c_saves_at_the_stopped_iteration_and_resumes_exactly(tmp_path, nproc, straight):
    ckpt, metrics = tmp_path / "ck", tmp_path / "first.jsonl"
    launch = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
    run = Run([*LONG, *launch, "--save", str(ckpt), "--metrics-file", str(metrics)])
    run.wait_for(r"iteration\s+3/")
    sent = run.interrupt()
    code, out, err = run.finish()
    assert time.monotonic() - sent <= STOP_S
    assert code == 130, err[-3000:]
    assert "Traceback" not in err + out, err[-3000:]
    assert len(err.splitlines()) == 1, err
    n = int(re.search(r"stopped at iteration (\d+);", err).group(1))
    assert 3 <= n < ITERS
    assert err == f"ptdp train: stopped at iteration {n}; saved to {ckpt / f'iter_{n:07d}'}"
    first = records(metrics)
    assert [r["iteration"] for r in first] == list(range(1, n + 1))
    # The checkpoint on disk is whole: latest names it, every checksum verifies, nothing temporary is left.
    assert read_latest(ckpt) == n
    read_full_model_state(ckpt)
    assert not list(ckpt.glob(".tmp-*"))
    # No heartbeat is left behind, inside the checkpoint directory or in the run directory beside it.
    assert not (ckpt / "hang").exists() and not Path(f"{ckpt}.run").exists()
    first_line = ("ptdp train: 2 worker(s), layout t=1 p=1 d=2: checking" if nproc > 1
                  else "ptdp train: one process, layout t=1 p=1 d=1: checking")
    assert out.startswith(first_line), out[:300]  # the first line, before anything slow

    # the resumed run is no Ctrl-C test: in ranks of the session's pool, the same train() as the workers
    got = losses(first) + losses(train_metrics(tmp_path, nproc, ["--train-iters", str(ITERS), "--load", str(ckpt)]))
    assert len(got) == ITERS
    if nproc == 1:
        assert got == straight  # the same layout: bit for bit
    assert got == pytest.approx(straight, rel=1e-5)


def test_second_ctrl_c_during_the_save_stops_at_once_and_the_previous_checkpoint_loads(tmp_path):
    ckpt = tmp_path / "ck"
    args = [*LONG, "--save", str(ckpt), "--save-interval", "2"]
    # Every save after iteration 2's waits a minute between its data files and its commit: the second Ctrl-C
    # lands inside it however fast (or, beside other work, however late) it comes.
    run = Run([*args, "--nproc-per-node", "2"], env={"PTDP_TEST_SLOW_SAVE": "3:60"})
    run.wait_for(r"iteration\s+3/")
    assert read_latest(ckpt) == 2
    run.interrupt()
    deadline = time.monotonic() + 60
    while not list(ckpt.glob(".tmp-iter_*")) and time.monotonic() < deadline:
        time.sleep(0.002)
    assert list(ckpt.glob(".tmp-iter_*")), "the save of the stopped iteration never started"
    sent = run.interrupt()
    code, out, err = run.finish()
    assert time.monotonic() - sent <= STOP_S
    assert code == 130, err[-3000:]
    assert "Traceback" not in err + out, err[-3000:]
    lines = err.splitlines()
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
    run = Run([*LONG])
    run.wait_for(r"iteration\s+3/")
    run.interrupt()
    code, out, err = run.finish()
    assert code == 130, err[-3000:]
    assert "Traceback" not in err + out
    assert re.fullmatch(r"ptdp train: stopped at iteration \d+; nothing saved \(no --save\)", err), err


def test_a_signal_while_the_reader_thread_starts_is_heard_not_raised():
    """Starting the signal thread took seconds on a loaded CI machine, and a Ctrl-C in that window raised
    KeyboardInterrupt through ``python -m ptdp`` (a traceback beside the one line). Here the signal is sent
    from inside ``Thread.start``: it must reach the callback, with no exception in the main thread."""
    script = textwrap.dedent("""
        import os, signal, threading, time
        from ptdp.runtime import signals
        start = threading.Thread.start
        def start_after_a_signal(self):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
            start(self)
        threading.Thread.start = start_after_a_signal
        heard = threading.Event()
        signals.on(signal.SIGINT, lambda signum: heard.set())
        signals.install(signal.SIGINT)
        print("heard" if heard.wait(10) else "lost")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.returncode == 0 and proc.stdout.strip() == "heard", proc.stderr[-2000:]
