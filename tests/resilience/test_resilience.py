"""Checkpoints that neither stall nor break, hang detection with a culprit, elastic restarts.

All runs are real ``ptdp train`` processes of the tiny model; every run that is killed or hangs on purpose
is bounded by ``run_command``'s timeout, which kills its whole process group."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import TINY, run_ptdp, track, train_metrics

from ptdp.checkpointing import read_full_model_state, read_latest
from ptdp.checkpointing.storage import verify_checksums

SIX = [*TINY, "--train-iters", "6"]
D2 = ["--nproc-per-node", "2"]


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    """Six iterations on two data-parallel ranks, never interrupted, saving (inline) every 2 iterations."""
    tmp = tmp_path_factory.mktemp("straight")
    got = train_metrics(tmp, 2, ["--save", str(tmp / "ckpt"), "--save-interval", "2"], base=SIX)
    return {"track": track(got), "records": got, "ckpt": tmp / "ckpt"}  # (loss, grad norm) per iteration


def test_async_save_writes_the_same_checkpoints_and_reports_the_stall(tmp_path, straight):
    ckpt = tmp_path / "async"
    got = train_metrics(tmp_path, 2, ["--save", str(ckpt), "--save-interval", "2", "--async-save"], base=SIX)
    assert track(got) == straight["track"]  # saving in the background changes nothing in training
    for run, root in ((got, ckpt), (straight["records"], straight["ckpt"])):
        assert read_latest(root) == 6 and not list(root.glob(".tmp-*"))
        stalls = {r["iteration"]: r["checkpoint_stall_s"] for r in run}
        assert {i for i, s in stalls.items() if s is not None} == {3, 5}  # the saves after iterations 2 and 4
    for iteration in (2, 4, 6):
        verify_checksums(ckpt / f"iter_{iteration:07d}")  # every file durable and listed
        a, _ = read_full_model_state(straight["ckpt"] / f"iter_{iteration:07d}")
        b, _ = read_full_model_state(ckpt / f"iter_{iteration:07d}")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # a copy, not the live tensors


def test_killed_during_saves_resumes_each_time_from_the_previous_checkpoint(tmp_path, straight):
    """Two crashes in one job (one launcher start for both): rank 1 dies in the background write of save 4,
    after fsync and hashing; after the restart, rank 0 dies in save 6 after the rename into place, before
    ``latest`` moves. Each restart must load the checkpoint before the partial one (2, then 4)."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    proc = run_ptdp(["train", *SIX, *D2, "--async-save", "--max-restarts", "2", "--save", str(ckpt), "--load",
                     str(ckpt), "--save-interval", "2", "--metrics-file", str(metrics)],
                    env={"PTDP_TEST_CRASH_IN_SAVE": "4:hashed,6:before-latest"}, check=False, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for point in ("4-hashed", "6-before-latest"):
        assert (ckpt / f".test-crashed-{point}").exists(), point  # the kill really happened
    loaded = [int(i) for i in re.findall(r" loaded checkpoint \S+ at iteration (\d+)", proc.stdout)]
    assert loaded == [2, 4], proc.stdout[-3000:]  # never the partial save
    got = {}
    for r in records(metrics):  # each restart logs its iterations again: the last record counts
        got[r["iteration"]] = (r["loss"], r["grad_norm"])
    assert [got[i] for i in range(1, 7)] == straight["track"]  # same layout: bit for bit
    assert read_latest(ckpt) == 6 and not list(ckpt.glob(".tmp-*"))
    for iteration in (2, 4, 6):
        verify_checksums(ckpt / f"iter_{iteration:07d}")


def test_a_stopped_worker_is_named_and_the_job_restarts_with_the_same_losses(tmp_path, straight):
    """SIGSTOP to rank 1 at iteration 4: rank 0 waits in a collective; within --hang-timeout-s + 5 s its
    watchdog names rank 1, writes every rank's last operations and exits; torchrun restarts from iteration 2."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    timeout = 5
    proc = run_ptdp(["train", *SIX, *D2, "--max-restarts", "1", "--save", str(ckpt), "--load", str(ckpt),
                     "--save-interval", "2", "--hang-timeout-s", str(timeout), "--metrics-file", str(metrics)],
                    env={"PTDP_TEST_KILL_AT_ITERATION": "4:STOP"}, check=False, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hang = [line for line in proc.stderr.splitlines() if "hang:" in line]
    assert len(hang) == 1 and "rank(s) 1 stopped responding (last heartbeat" in hang[0], hang
    assert "rank 0 waits in" in hang[0], hang
    assert proc.stderr.splitlines() == hang  # nothing from torchrun beside it
    report = tmp_path / "ckpt.run" / "hang"  # beside the checkpoint directory, not inside it
    assert (report / "report-attempt0.txt").read_text().strip() in hang[0]
    stopped_at = (tmp_path / ".test-killed-ckpt.run-4").stat().st_mtime  # touched just before the SIGSTOP
    named_at = (report / "report-attempt0.txt").stat().st_mtime
    assert named_at - stopped_at <= timeout + 5, named_at - stopped_at
    for rank in (0, 1):  # every rank's last operations, the stopped one's from its last heartbeat
        ops = json.loads((report / f"rank{rank}-ops.json").read_text())
        assert ops["rank"] == rank and ops["iteration"] >= 1
    # the waiting rank names its last call; the stopped one may have stopped before a heartbeat with calls
    assert json.loads((report / "rank0-ops.json").read_text())["ops"]
    got = {r["iteration"]: (r["loss"], r["grad_norm"]) for r in records(metrics)}
    assert [got[i] for i in range(1, 7)] == straight["track"]  # restarted from iteration 2: bit for bit


def test_the_launcher_says_nothing_of_the_stopped_rank_the_hang_reporter_killed(tmp_path, capsys):
    """The hang reporter SIGKILLs a stopped rank on its host and exits 3; torchrun may see the kill first.
    A signal death after a new hang report is that report's consequence; one without it gets its line."""
    import logging

    from ptdp.runtime.launch import _WorkerFailures

    def failure(code: int) -> logging.LogRecord:
        return logging.LogRecord("torch.distributed.elastic", logging.ERROR, __file__, 0,
                                 "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
                                 (code, 1, 123, "python"), None)

    hang = tmp_path / "hang"
    hang.mkdir()
    (hang / "report-attempt0.txt").write_text("an earlier job's\n")
    failures = _WorkerFailures(3, single_node=True, hang_dir=hang)
    failures.emit(failure(-9))  # an earlier job's report says nothing of this kill
    (hang / "report-attempt1.txt").write_text("hang: rank(s) 1 stopped responding\n")
    failures.emit(failure(-9))  # killed by the reporter
    failures.emit(failure(-9))  # no new report since: unexplained
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"ptdp train: worker rank 1 killed by SIGKILL; restarting every worker from the latest "
                     f"checkpoint (restart {n} of 3)" for n in (1, 3)], lines
