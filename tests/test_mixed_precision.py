"""--bf16 / --fp16: 16-bit weights and activations with fp32 main weights track fp32 training; fp16
overflows are skipped, counted and back the loss scale off."""

from __future__ import annotations

import pytest
from helpers import LAYOUT_2222, losses, run_ptdp, train_metrics

STEPS = ["--train-iters", "20", "--lr", "3e-3"]
TRACK = 0.02  # 16-bit rounding: within 2% of fp32 over 20 steps
@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    return losses(train_metrics(tmp_path_factory.mktemp("fp32"), 1, STEPS))


def check_tracks(got: list[float], fp32: list[float]) -> None:
    assert got == pytest.approx(fp32, rel=TRACK)
    assert got != pytest.approx(fp32, rel=1e-6), "identical to fp32: the 16-bit mode did not run"
    assert sum(got[-5:]) / 5 < sum(got[:5]) / 5 - 0.3  # it learns


@pytest.mark.parametrize("extra", [
    ["--bf16"],
    ["--fp16", "--initial-loss-scale", "4096"],
], ids=["bf16", "fp16"])
def test_16bit_tracks_fp32(tmp_path, fp32, extra):
    records = train_metrics(tmp_path, 1, [*STEPS, *extra])
    check_tracks(losses(records), fp32)
    assert records[-1]["skipped_iterations"] == 0


def test_bf16_distributed_optimizer_overlap_t2p2d2v2(tmp_path, fp32):
    extra = ["--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce", *LAYOUT_2222]
    check_tracks(losses(train_metrics(tmp_path, 8, [*STEPS, *extra])), fp32)


def test_fp16_overflow_is_skipped_and_scale_backs_off(tmp_path):
    # 2**20 overflows fp16 in the backward: each overflow halves the scale (hysteresis 1) and skips the step
    records = train_metrics(tmp_path, 1, ["--fp16", "--initial-loss-scale", str(2**20), "--hysteresis", "1",
                                          "--train-iters", "6"])
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
    records = train_metrics(tmp_path, 1, ["--fp16", "--initial-loss-scale", str(2**20), "--train-iters", "2"])
    assert [r["loss_scale"] for r in records] == [2**20, 2**19]
    assert [r["skipped_iterations"] for r in records] == [1, 2]


def test_static_loss_scale_fp32_grads(tmp_path, fp32):
    extra = ["--fp16", "--loss-scale", "1024", "--accumulate-allreduce-grads-in-fp32"]
    records = train_metrics(tmp_path, 1, [*STEPS, *extra])
    assert {r["loss_scale"] for r in records} == {1024.0}
    check_tracks(losses(records), fp32)


@pytest.mark.parametrize("extra,message", [
    (["--bf16", "--fp16"], "--bf16 and --fp16 are exclusive"),
    (["--loss-scale", "8"], "--loss-scale 8.0 needs --fp16"),
])
def test_bad_precision_flags(extra, message):
    proc = run_ptdp(["train", *extra], check=False, timeout=60)
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr
