"""``ptdp plan --optimizer muon``: Muon's bytes (one momentum on the hidden matrices, AdamW's two moments on the
rest) and its step (Newton–Schulz spread over the grid, the fp32 exchange), counted independently here from
a GPT layer's 12h² matrix parameters (4h² attention, 8h² MLP: docs/references.md, §Muon)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ptdp.planner.memory import memory_per_gpu
from ptdp.planner.muon import muon_work
from ptdp.planner.perf import iteration_times
from ptdp.planner.spec import ClusterSpec, GPTSpec, ParallelConfig, TrainingSpec

GPT = GPTSpec(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=1024, vocab_size=51200)
CLUSTER = ClusterSpec.of("h100-80gb", 32)


def ns_flops(rows: int, cols: int, steps: int = 5) -> float:
    n, m = sorted((rows, cols))
    return 2 * steps * (2 * m * n * n + n**3)


@pytest.mark.parametrize("strategy,shards", [("no_shard", 1), ("optim", 8), ("optim_grads_params", 8)])
@pytest.mark.parametrize("t", [1, 2])
def test_muon_saves_four_bytes_per_hidden_matrix_parameter_sharded_like_the_state(strategy, shards, t):
    cfg = ParallelConfig(t, 2, 8, sharding_strategy=strategy)
    adam, muon = (memory_per_gpu(GPT, cfg, 64, "bf16", o) for o in ("adam", "muon"))
    matrices = 12 * GPT.hidden_size**2 * GPT.num_layers / 2 / t  # the pipeline rank's layers, its TP slices
    assert adam.model_states - muon.model_states == pytest.approx(4 * matrices / shards)


def test_the_newton_schulz_work_is_spread_over_the_grid():
    """Each rank orthogonalises 1/(t·d) of its stage's matrices, whole: the FLOPs of the full shapes."""
    layer = (3 * ns_flops(1024, 1024) + ns_flops(1024, 1024)  # Q, K, V apart; the output projection
             + ns_flops(4096, 1024) + ns_flops(1024, 4096))  # fc1, fc2
    for t, d in ((1, 1), (1, 4), (2, 4)):
        work = muon_work(GPT, ParallelConfig(t, 2, d), layers=4)
        assert sum(n * ns_flops(r, c) for r, c, n in work.matrices) == pytest.approx(4 * layer / (t * d))


def test_the_exchange_moves_a_dth_under_zero_and_the_whole_slices_without():
    slices = 12 * 1024**2 * 4 / 2 * 4  # fp32 bytes of 4 layers' TP slices at t = 2
    assert muon_work(GPT, ParallelConfig(2, 2, 4), 4).dp_bytes == pytest.approx(slices)  # the broadcast
    zero = muon_work(GPT, ParallelConfig(2, 2, 4, sharding_strategy="optim"), 4)
    assert (zero.dp_bytes, zero.tp_bytes) == pytest.approx((2 * slices / 4, 2 * slices / 4))


def test_muons_step_costs_time_and_shrinks_with_d():
    def optimizer_seconds(d: int, optimizer: str) -> float:
        cfg = ParallelConfig(1, 1, d, sharding_strategy="optim")
        return iteration_times(GPT, cfg, ClusterSpec.of("h100-80gb", d), TrainingSpec(64, "bf16", False, optimizer)).optimizer

    assert optimizer_seconds(1, "muon") > optimizer_seconds(1, "adam")
    assert optimizer_seconds(8, "muon") < optimizer_seconds(1, "muon") / 4


def test_plan_command_reports_muons_bytes():
    argv = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
            "--vocab-size", "51200", "--gpus", "8", "--global-batch-size", "64", "--bf16", "--top", "1"]
    out = {o: subprocess.run([sys.executable, "-m", "ptdp", "plan", *argv, "--optimizer", o], capture_output=True,
                             text=True, check=True).stdout for o in ("adam", "muon")}
    assert "x 18 B/param (bf16 + Adam)" in out["adam"]
    assert "B/param (bf16 + Muon's momentum; Adam on the rest)" in out["muon"]
    assert "x 18 B/param" not in out["muon"]
