"""benchmarks/gpu_suite.py on the CPU: ``--dry-run`` runs every part at toy size and writes the JSON of a GPU
run; one part's crash or hang leaves the others' results. The GPU run itself is the device tool's.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import worker_env

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_suite  # noqa: E402


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path_factory.mktemp("gpu_suite") / "dry.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, env=worker_env(), timeout=900)
    return proc, json.loads(out.read_text())


def test_dry_run_runs_every_part_and_writes_the_json_shape(dry_run):
    proc, report = dry_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report["dry_run"] is True and not report["shape_errors"]
    assert set(report["parts"]) == set(gpu_suite.all_parts())
    statuses = {name: part["status"] for name, part in report["parts"].items()}
    assert statuses.pop("document_masking") in ("not built yet", "ok")  # the packed-document kernel, once it exists
    assert set(statuses.values()) == {"ok"}, statuses
    tests = report["parts"]["pytest_gpu"]["result"]
    assert tests["skipped"] > 0 and tests["failed"] == tests["error"] == 0  # no CUDA: every GPU test skips
    assert report["parts"]["zero3_layer_gather"]["result"]["max_abs_grad_diff"] == 0.0
    assert report["summary"]["statuses"] == {name: part["status"] for name, part in report["parts"].items()}


def test_shape_check_catches_a_missing_figure(dry_run):
    _, report = dry_run
    broken = json.loads(json.dumps(report))
    del broken["parts"]["gpt_1p3b"]["result"]["mfu"]
    broken["parts"]["fp8"]["status"] = "exploded"
    errors = gpu_suite.shape_errors(broken, dry_run=True)
    assert any("gpt_1p3b: no 'mfu'" in e for e in errors) and any("fp8: status 'exploded'" in e for e in errors)


def _crash(ctx) -> None:
    ctx.emit(before=1)
    os._exit(3)  # as a segfault or the OOM killer would: no exception, no status written


def _hang(ctx) -> None:
    ctx.emit(partial=1)
    time.sleep(600)


def _raise(ctx) -> None:
    raise RuntimeError("the second line is not reported\nsecond")


def _fine(ctx) -> None:
    ctx.emit(value=2)


def test_a_part_that_crashes_hangs_or_raises_leaves_the_others(tmp_path, monkeypatch):
    """Each part in its own process and session: its budget kills a hang, and what it emitted survives."""
    parts = {"crash": (_crash, 30, ()), "hang": (_hang, 2, ()), "raise": (_raise, 30, ()), "fine": (_fine, 30, ())}
    monkeypatch.setattr(gpu_suite, "all_parts", lambda: parts)
    ctx = mp.get_context("fork")  # the patched table reaches the child (the suite itself uses a forkserver)
    got = {name: gpu_suite.run_part(ctx, name, budget, False, str(tmp_path)) for name, (_, budget, _) in parts.items()}
    assert got["crash"]["status"] == "failed" and "exit code 3" in got["crash"]["error"]
    assert got["crash"]["result"] == {"before": 1}
    assert got["hang"]["status"] == "timeout" and got["hang"]["result"] == {"partial": 1}
    assert got["hang"]["seconds"] < 30
    assert got["raise"]["status"] == "failed" and got["raise"]["error"] == "RuntimeError: the second line is not reported"
    assert got["fine"] == {**got["fine"], "status": "ok", "result": {"value": 2}, "error": None}
