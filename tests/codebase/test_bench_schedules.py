"""Smoke test of benchmarks/schedules.py: every schedule runs and reports every key; the synthetic torch
stage costs what torch's own B/W split should see (I = t_B, W = t_W, full B = t_B + t_W)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from ptdp.schedule.registry import SCHEDULES

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import schedules as bench  # noqa: E402

KEYS = {"p", "v", "m", "ours_s", "torch_s", "ideal_s", "time_over_ideal", "time_over_torch", "torch_over_ideal",
        "bubble_fraction", "bubble_fraction_formula", "busy_over_work"}


def test_sleep_chunk_costs_under_torch_split(monkeypatch) -> None:
    """torch's stage_backward_input runs only the t_B sleep, stage_backward_weight only the t_W one, a full
    backward both: the sleeps each call asks for are recorded (not timed, which a loaded machine skews)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    slept: list[float] = []
    monkeypatch.setattr(bench.time, "sleep", slept.append)
    t_b, t_w = 0.15, 0.05
    chunk = bench.SleepChunk(0.0, t_b, t_w)
    x = torch.randn(2, 4, requires_grad=True)
    y = chunk(x)
    grad = torch.ones_like(y)
    slept.clear()  # the forward's t_F = 0 sleeps, if any
    held = stage_backward_input([y], [grad], [x], iter(chunk.parameters()))
    assert [s for s in slept if s] == [t_b], slept
    slept.clear()
    stage_backward_weight(iter(chunk.parameters()), held[1])
    assert [s for s in slept if s] == [t_w], slept
    assert chunk.scale.grad is not None and x.grad is not None
    z = chunk(x.detach())  # a first stage: torch runs the full backward there, which must cost both
    slept.clear()
    torch.autograd.backward(z, torch.ones_like(z))
    assert sorted(s for s in slept if s) == sorted([t_b, t_w]), slept


def test_benchmark_json_has_every_schedule(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "schedules.py"), "--p", "2", "--m", "4", "--t-f", "0.001",
           "--repeats", "1", "--warmup", "0", "--json"]
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = proc.stdout.splitlines()
    report = json.loads(line)
    assert set(report) == set(SCHEDULES)
    for name, r in report.items():
        assert KEYS <= set(r), name
        assert r["m"] == 4 and r["ours_s"] > 0  # dualpipev needs m >= 2p
        assert (r["torch_s"] is None) == (name not in bench.TORCH_SCHEDULES), name


def test_bad_flag_is_one_line() -> None:
    assert bench.main(["--t-w", "0"]) == 2
