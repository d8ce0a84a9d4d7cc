"""--bf16 / --fp16: 16-bit weights and activations with fp32 main weights track fp32 training; fp16
overflows are skipped, counted and back the loss scale off."""

from __future__ import annotations

import pytest
from helpers import LAYOUT_2222, TINY, assert_same_run, refused_in_process, run_layouts

STEPS = ["--train-iters", "20", "--lr", "3e-3"]
TRACK = 0.02  # 16-bit rounding: within 2% of fp32 over 20 steps (losses and gradient norms)
OVERFLOW = ["--fp16", "--initial-loss-scale", str(2**20)]  # 2**20 overflows fp16 in the backward
PLAN = {
    "fp32": (1, STEPS),
    "bf16": (1, [*STEPS, "--bf16"]),
    "fp16": (1, [*STEPS, "--fp16", "--initial-loss-scale", "4096"]),
    "bf16-distopt-overlap-2222": (8, [*STEPS, "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce",
                                      *LAYOUT_2222]),
    "fp16-static-fp32-grads": (1, [*STEPS, "--fp16", "--loss-scale", "1024", "--accumulate-allreduce-grads-in-fp32"]),
    "fp16-overflow-hysteresis-1": (1, [*OVERFLOW, "--hysteresis", "1", "--train-iters", "6"]),
    "fp16-overflow": (1, [*OVERFLOW, "--train-iters", "2"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("precision"), PLAN, save=False)  # losses only: no final save


def check_tracks(got, fp32) -> None:
    assert_same_run(got, fp32, TRACK)
    assert got.losses != pytest.approx(fp32.losses, rel=1e-6), "identical to fp32: the 16-bit mode did not run"
    assert sum(got.losses[-5:]) / 5 < sum(got.losses[:5]) / 5 - 0.3  # it learns


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_16bit_tracks_fp32(runs, name):
    check_tracks(runs[name], runs["fp32"])
    assert runs[name].records[-1]["skipped_iterations"] == 0


def test_bf16_distributed_optimizer_overlap_t2p2d2v2(runs):
    check_tracks(runs["bf16-distopt-overlap-2222"], runs["fp32"])


def test_fp16_overflow_is_skipped_and_scale_backs_off(runs):
    # each overflow halves the scale (hysteresis 1) and skips the step
    records = runs["fp16-overflow-hysteresis-1"].records
    skipped = [r["skipped_iterations"] for r in records]
    assert records[0]["skipped_iterations"] == 1 and records[0]["loss_scale"] == 2**19
    for before, after in zip(records, records[1:], strict=False):
        halved = after["skipped_iterations"] == before["skipped_iterations"] + 1
        assert after["loss_scale"] == before["loss_scale"] / (2 if halved else 1)
    assert 1 <= skipped[-1] < len(records)  # the scale came down far enough for steps to happen
    stepped = [r for prev, r in zip(records, records[1:], strict=False)
               if r["skipped_iterations"] == prev["skipped_iterations"]]
    assert stepped and all(r["grad_norm"] < 100 for r in stepped)  # finite, unscaled norms
    # Default hysteresis 2: the first overflow keeps the scale, the second halves it.
    records = runs["fp16-overflow"].records
    assert [r["loss_scale"] for r in records] == [2**20, 2**19]
    assert [r["skipped_iterations"] for r in records] == [1, 2]


def test_static_loss_scale_fp32_grads(runs):
    got = runs["fp16-static-fp32-grads"]
    assert {r["loss_scale"] for r in got.records} == {1024.0}
    check_tracks(got, runs["fp32"])


@pytest.mark.parametrize("extra,message", [
    (["--bf16", "--fp16"], "--bf16 and --fp16 are exclusive"),
    (["--loss-scale", "8"], "--loss-scale 8.0 needs --fp16"),
])
def test_bad_precision_flags(extra, message, capsys):
    proc = refused_in_process(["train", *extra], capsys)
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr


def test_fp16_without_a_gpu_is_refused_in_one_line_naming_what_to_use(monkeypatch, capsys):
    """On the CPU --fp16 ran with "grad norm: nan" for many iterations: refused at start-up, before training."""
    import torch

    from ptdp.cli.main import main as ptdp_main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ptdp_main(["train", *TINY, "--fp16"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("ptdp train: error: --fp16 needs a CUDA GPU") and "--bf16" in line and "fp32" in line


def test_bf16_on_the_cpu_warns_once_that_it_is_slow(monkeypatch):
    import torch

    from ptdp.config import Config, derive
    from ptdp.runtime.startup import startup_warnings

    config = Config()
    config.precision.bf16 = True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (line,) = startup_warnings(config, derive(config))
    assert line.startswith("--bf16 on the CPU: it trains, but much slower than fp32")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert startup_warnings(config, derive(config)) == []
