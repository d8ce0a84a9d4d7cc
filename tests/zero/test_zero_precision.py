"""ZeRO-3 with 16-bit parameters (bf16; fp16 with dynamic loss scaling and its skipped steps) trains
exactly what the same layout trains without sharding, and the Llama model (RoPE, RMSNorm, SwiGLU,
untied output) under ZeRO-3 in a pipeline matches one process. One spawn of 4 processes."""

from __future__ import annotations

import math

import pytest
from helpers import assert_equivalent, assert_same_weights, run_layouts

Z3 = ["--data-parallel-sharding-strategy", "optim_grads_params", "--grad-bucket-size-mb", "0.001"]
P2V2 = ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
        "--pipeline-schedule", "interleaved"]
BF16 = ["--bf16", *P2V2]
FP16 = ["--fp16", "--initial-loss-scale", "65536", "--loss-scale-window", "2", "--train-iters", "5",
        "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"]
LLAMA = ["--model", "tiny-llama", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
         "--lr-warmup-iters", "1", "--train-iters", "3", "--log-interval", "1"]
PLAN = {
    "bf16-no-shard": (4, BF16),
    "bf16-z3": (4, [*BF16, *Z3]),
    "fp16-no-shard": (4, FP16),
    "fp16-z3": (4, [*FP16, *Z3, "--recompute-granularity", "full"]),
}
LLAMA_PLAN = {
    "llama-reference": (1, []),
    "llama-z3-p2d2-1f1b": (4, [*Z3, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b",
                               "--recompute-granularity", "full"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero16")
    out = run_layouts(tmp / "gpt", PLAN)
    return out | run_layouts(tmp / "llama", LLAMA_PLAN, base=LLAMA)


def test_zero3_bf16_matches_no_shard(runs):
    assert_equivalent(runs["bf16-z3"], runs["bf16-no-shard"], 1e-5)


def test_zero3_fp16_with_loss_scaling_matches_no_shard(runs):
    """Same losses, same norms (inf on the same skipped steps), same loss scales, same final weights."""
    got, want = runs["fp16-z3"], runs["fp16-no-shard"]
    scales = [r["loss_scale"] for r in got.records]
    assert scales == [r["loss_scale"] for r in want.records] and len(set(scales)) > 1, scales
    assert any(not math.isfinite(r["grad_norm"]) for r in got.records)  # a skipped step happened
    for a, b in zip(got.records, want.records, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        if math.isfinite(b["grad_norm"]):
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        else:
            assert not math.isfinite(a["grad_norm"])
    assert_same_weights(got, want)


def test_zero3_llama_pipeline_matches_single_process(runs):
    assert_equivalent(runs["llama-z3-p2d2-1f1b"], runs["llama-reference"], 1e-4)
