"""A ``--save`` directory that holds another run's checkpoints is never written over by mistake.

``ptdp train --save DIR`` without ``--load DIR`` (or with ``--load`` elsewhere) would train from another
start, overwrite DIR's ``iter_*`` directories and move ``DIR/latest`` back (from 21 to 2), and ``--keep-last``
would rotate the other run's checkpoints away. The start-up checks stop such a run in one line naming the
two fixes (``--load DIR`` to continue, a fresh directory), before any worker starts; ``--load DIR --save
DIR`` continues as before. And ``--keep-last`` deletes only checkpoints of the run itself (those it wrote,
and those of the run it continued up to the one it loaded), whatever else shares the directory.

The start-up check reads only names (``latest``, ``iter_*``), so most directories here are made by hand;
one real launch shows the launcher refusing before a worker starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import TINY, run_ptdp, train_metrics

from ptdp.checkpointing import storage
from ptdp.checkpointing.validation import checkpoint_errors, other_run_errors
from ptdp.config import Config, config_from_args


def _config(*flags: str) -> Config:
    from ptdp.cli.main import build_parser

    return config_from_args(build_parser().parse_args(["train", *TINY, *flags]))


def _other_run(root: Path, iterations: tuple[int, ...] = (19, 21), latest: int | None = 21) -> Path:
    """A directory as another run's ``--save`` leaves it (only the names the checks read)."""
    for iteration in iterations:
        storage.iteration_dir(root, iteration).mkdir(parents=True)
    if latest is not None:
        (root / storage.LATEST).write_text(f"{latest}\n")
    return root


@pytest.fixture(autouse=True)
def _first_attempt(monkeypatch):
    """The tests run as a job's first attempt, whatever environment pytest was started in."""
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)


def test_save_into_another_runs_directory_without_load_is_refused_in_one_line(tmp_path):
    ckpt = _other_run(tmp_path / "ck")
    errors = checkpoint_errors(_config("--save", str(ckpt)), 1)
    assert errors == [f"--save {ckpt} already holds another run's checkpoints (latest iteration 21) and no --load "
                      f"is given: saving there would overwrite them and move {ckpt / 'latest'} back; pass --load "
                      f"{ckpt} to continue that run, or --save a fresh directory"]


def test_iteration_directories_without_latest_count_as_another_runs_checkpoints(tmp_path):
    ckpt = _other_run(tmp_path / "ck", (2, 4), latest=None)
    [line] = other_run_errors(str(ckpt), None)
    assert "(2 iter_* directories)" in line and f"--load {ckpt} to continue" in line


def test_save_into_another_runs_directory_with_load_elsewhere_is_refused(tmp_path):
    ckpt = _other_run(tmp_path / "ck")
    elsewhere = tmp_path / "base"
    elsewhere.mkdir()  # no checkpoint there: --load starts fresh, which is no reason to write over ck
    [line] = checkpoint_errors(_config("--save", str(ckpt), "--load", str(elsewhere)), 1)
    assert f"--load {elsewhere} starts elsewhere" in line and "--save a fresh directory" in line


def test_continuing_the_run_in_the_save_directory_passes(tmp_path):
    ckpt = _other_run(tmp_path / "ck")
    assert other_run_errors(str(ckpt), str(ckpt)) == []  # --load DIR --save DIR: continue
    assert other_run_errors(str(ckpt), str(ckpt / "iter_0000019")) == []  # from one of DIR's checkpoints
    assert other_run_errors(str(ckpt), str(tmp_path / "ck" / ".." / "ck")) == []  # the same directory, spelt otherwise


def test_an_empty_or_new_save_directory_passes(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / ".tmp-iter_0000002").mkdir()  # a save cut short leaves no checkpoint (removed at start-up)
    assert checkpoint_errors(_config("--save", str(empty)), 1) == []
    assert checkpoint_errors(_config("--save", str(tmp_path / "new")), 1) == []


def test_a_restarted_attempt_of_the_job_passes(tmp_path, monkeypatch):
    """torchrun's restart of a job without --load finds the checkpoints its first attempt wrote: not another
    run's (the first attempt passed the check before anything was saved)."""
    ckpt = _other_run(tmp_path / "ck")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert other_run_errors(str(ckpt), None) == []


def test_continues_tells_whether_load_lies_in_the_save_directory(tmp_path):
    ckpt = _other_run(tmp_path / "ck")
    assert storage.continues(ckpt, ckpt) and storage.continues(ckpt / "iter_0000021", ckpt)
    assert storage.continues(tmp_path / "new", tmp_path / "new")  # --load = --save before the first save
    assert not storage.continues(tmp_path / "base", ckpt) and not storage.continues(None, ckpt)


def test_keep_last_deletes_only_the_runs_own_checkpoints(tmp_path):
    """Another run's 19 and 21 share the directory: --keep-last 1 keeps the newest of the run's own (8, 10)
    and never touches theirs, which do not count towards the K either."""
    root = _other_run(tmp_path / "ck")
    for iteration in (6, 8):
        storage.iteration_dir(root, iteration).mkdir()
    (root / storage.LATEST).write_text("8\n")
    storage.prune(root, 1, {6, 8})
    assert storage.saved_iterations(root) == [8, 19, 21]
    storage.iteration_dir(root, 10).mkdir()
    (root / storage.LATEST).write_text("10\n")
    storage.prune(root, 1, {6, 8, 10})
    assert storage.saved_iterations(root) == [10, 19, 21]


def test_keep_last_after_a_rollback_neither_counts_nor_deletes_checkpoints_it_did_not_write(tmp_path):
    """A run saved 1 to 4; a copy stands for a later run's 21. ``--load DIR/iter_0000002 --save DIR
    --keep-last 2`` continues from 2 (an explicit roll-back) and saves 3 and 4 again: the run's own newest
    two (3, 4) stay, and so does 21, which it neither wrote nor loaded. (Counting 21 among the K, 3 went.)"""
    import shutil

    ckpt = tmp_path / "ck"
    train_metrics(tmp_path, 1, ["--train-iters", "4", "--save", str(ckpt), "--save-interval", "1"])
    assert storage.saved_iterations(ckpt) == [1, 2, 3, 4]
    shutil.copytree(storage.iteration_dir(ckpt, 4), storage.iteration_dir(ckpt, 21))
    records = train_metrics(tmp_path, 1, ["--train-iters", "4", "--load", str(storage.iteration_dir(ckpt, 2)),
                                          "--save", str(ckpt), "--save-interval", "1", "--keep-last", "2"])
    assert [r["iteration"] for r in records] == [3, 4]
    assert storage.saved_iterations(ckpt) == [3, 4, 21] and storage.read_latest(ckpt) == 4


@pytest.mark.parametrize("launch", [["--nproc-per-node", "2"], []], ids=["launcher", "one-process"])
def test_train_refuses_another_runs_directory_before_any_worker_starts(tmp_path, launch):
    ckpt = _other_run(tmp_path / "ck")
    before = sorted(p.name for p in ckpt.iterdir())
    markers = tmp_path / "workers"
    markers.mkdir()
    proc = run_ptdp(["train", *TINY, *launch, "--save", str(ckpt), "--keep-last", "1"],
                    check=False, env={"PTDP_TEST_WORKER_MARKER": str(markers)})
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ptdp train: error: --save {ckpt} already holds another run's"), \
        proc.stderr[-3000:]
    assert f"--load {ckpt} to continue" in lines[0]
    assert not list(markers.iterdir()), "a worker started"
    assert sorted(p.name for p in ckpt.iterdir()) == before and storage.read_latest(ckpt) == 21


def test_writing_a_model_into_another_runs_directory_is_refused(tmp_path):
    """``ptdp import --save DIR`` (``write_full_model_state``) writes iteration 0: into a run's directory it
    would move ``latest`` back to 0. It stops with one line (``ptdp import`` prints it) and writes nothing."""
    from ptdp.checkpointing import CheckpointError, write_full_model_state

    ckpt = _other_run(tmp_path / "ck")
    before = sorted(p.name for p in ckpt.iterdir())
    with pytest.raises(CheckpointError, match="already holds a run's checkpoints.*--save a fresh directory"):
        write_full_model_state(ckpt, {}, {"model": {}})
    assert sorted(p.name for p in ckpt.iterdir()) == before and storage.read_latest(ckpt) == 21
