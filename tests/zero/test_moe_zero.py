"""Mixture-of-experts models under ZeRO-2, ZeRO-3 and hybrid sharding: every layout
trains the tiny MoE model as one process does -- per iteration the loss AND the gradient norm (an expert
shard counted twice, or once per hybrid instance, changes the norm, not the losses), and the final weights.

Dense parameters shard over the dp-cp group, expert parameters over their expert-data-parallel group
(``ptdp.parallel.expert.grads``): with (e, d) = (2, 2) that group is one rank (only the dense part is
sharded), with (e, d) = (2, 4), (t, e, d) = (2, 2, 2) folded and (p, d) = (2, 2) at e = 1 it has two, so
both parts are sharded and ZeRO-3 gathers each chunk's dense and expert buckets over two groups. Hybrid
sharding cuts both groups into K = 2 instances (at (e, d) = (2, 4) an expert instance is a single rank).
A checkpoint saved under ZeRO-3 with experts continues identically at e = 1 without sharding, and under
ZeRO-3 again in another layout ((t, e, d) = (2, 2, 2) folded, with sequence parallelism); in bf16, ZeRO-3
with experts trains what the same layout trains unsharded. Small
buckets, so parameters straddle the shard boundaries. All in one spawn of four processes.
"""

from __future__ import annotations

import pytest
from helpers import assert_equivalent, assert_same_run, run_layouts
from test_moe_parallel import MOE

RTOL = 1e-4
SMALL = ["--grad-bucket-size-mb", "0.001"]
Z2 = ["--data-parallel-sharding-strategy", "optim_grads", *SMALL]
Z3 = ["--data-parallel-sharding-strategy", "optim_grads_params", *SMALL]
E2 = ["--expert-model-parallel-size", "2"]
P2 = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule"]
K2 = ["--num-distributed-optimizer-instances", "2"]
T2 = ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]


def plan(ckpt) -> dict[str, tuple[int, list[str]]]:
    return {
        "one": (1, []),
        "e2d2-z2": (2, [*E2, *Z2]),
        "e2d4-z2-overlap": (4, [*E2, *Z2, "--overlap-grad-reduce"]),
        "e2d4-z3-overlap": (4, [*E2, *Z3, "--overlap-grad-reduce"]),
        "p2d2e2-z3-1f1b": (4, [*P2, "1f1b", *E2, *Z3]),
        "p2d2-z3-zbv-reshard": (4, [*P2, "zbv", *Z3, "--reshard-after-forward"]),
        "t2e2d2-z3": (4, [*T2, *E2, *Z3]),
        "e2d4-z3-reshard-per-layer": (4, [*E2, *Z3, "--reshard-after-forward"]),
        "e2d4-z3-hybrid-k2": (4, [*E2, *Z3, *K2]),
        "d4-z2-hybrid-k2": (4, [*Z2, *K2]),
        "e2d4-bf16-no-shard": (4, [*E2, "--bf16"]),
        "e2d4-bf16-z3": (4, [*E2, "--bf16", *Z3]),
        "e2d4-z3-save": (4, [*E2, *Z3, "--exit-interval", "2", "--save", str(ckpt)]),
        "e1-resume-no-shard": (1, ["--load", str(ckpt)]),
        "t2e2d2-sp-z3-resume": (4, [*T2, "--sequence-parallel", *E2, *Z3, "--load", str(ckpt)]),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe-zero")
    return run_layouts(tmp, plan(tmp / "ckpt"), base=MOE)


EQUIVALENT = [n for n in plan("x") if n != "one" and not n.endswith("-save") and "bf16" not in n]


@pytest.mark.parametrize("name", EQUIVALENT)
def test_moe_under_zero_matches_one_process(runs, name):
    assert [r["iteration"] for r in runs[name].records] == ([3] if "resume" in name else [1, 2, 3])
    assert_equivalent(runs[name], runs["one"], RTOL)


def test_zero3_with_experts_in_bf16_matches_no_shard(runs):
    """16-bit parameters (the fp32 master copies sharded with the rest): what the same layout trains unsharded."""
    assert_equivalent(runs["e2d4-bf16-z3"], runs["e2d4-bf16-no-shard"], 1e-5)


def test_checkpoint_saved_under_zero3_with_experts(runs):
    """Saved after iteration 2 at (e, d) = (2, 4) ZeRO-3; its continuations (at e = 1 without sharding, and
    at (t, e, d) = (2, 2, 2) ZeRO-3: every rank reads only its dense and expert shards) are checked above."""
    saved = runs["e2d4-z3-save"]
    assert [r["iteration"] for r in saved.records] == [1, 2]
    assert_same_run(saved, runs["one"], RTOL)


def test_expert_weights_are_sharded_too(runs):
    """fp32 Adam, 16 bytes a parameter: at (e, d) = (2, 4) ZeRO-3 a rank keeps 1/4 of the dense parameters'
    states and 1/2 of its half of the experts' (16n/4 in all; 16(n_dense/4 + n_expert/2) if the experts
    stayed whole). Under hybrid K = 2 the dense part is split over 2 ranks, the experts over 1: 16n/2."""
    weights = runs["one"].weights
    n = sum(t.numel() for t in weights.values())
    n_expert = sum(t.numel() for name, t in weights.items() if ".experts." in name)
    assert n_expert > n / 4, (n_expert, n)  # the check below tells the two apart
    z3 = runs["e2d4-z3-overlap"].records[-1]["model_state_bytes"]
    assert 16 * n / 4 <= z3 <= 1.02 * 16 * n / 4, (z3, n, n_expert)
    hybrid = runs["e2d4-z3-hybrid-k2"].records[-1]["model_state_bytes"]
    assert 16 * n / 2 <= hybrid <= 1.02 * 16 * n / 2, (hybrid, n)


def _problems(args: list[str], world: int) -> list[str]:
    import argparse

    from ptdp.config import add_config_arguments, config_from_args, validate

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return validate(config_from_args(parser.parse_args([*MOE, *args])), world)


def test_every_strategy_is_accepted_with_experts_and_hybrid_needs_k_to_divide_edp():
    for strategy in ("optim", "optim_grads", "optim_grads_params"):
        assert _problems([*E2, "--data-parallel-sharding-strategy", strategy], 4) == []
        assert _problems([*E2, "--data-parallel-sharding-strategy", strategy, *K2], 4) == []  # edp = 2
    # (e, d) = (2, 2): one expert-DP rank, nothing to cut into two instances
    bad = _problems([*E2, "--data-parallel-sharding-strategy", "optim_grads_params", *K2], 2)
    assert len(bad) == 1 and "--num-distributed-optimizer-instances 2" in bad[0] and "expert-data-parallel size 1" \
        in bad[0], bad
