"""A mixture-of-experts model (aux loss and z-loss on, dropless) trains identically in the layouts that
need no expert parallelism: data parallelism (with ZeRO-1), pipeline 1F1B, the zero-bubble V schedule (its W pass
computes the experts' and the router's weight gradients), full recomputation, tensor parallelism of the
attention (the MoE layer replicated over t without sequence parallelism) -- losses, gradient norms,
the MoE metrics per iteration and the final weights, against one process. Expert parallelism's layouts
are tested with it (tests/parallel/test_expert_parallel.py)."""

from __future__ import annotations

import pytest
from helpers import TINY, assert_equivalent, run_layouts

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff",
       "0.001", "--moe-layer-freq", "[1,1,0,1]", "--moe-shared-expert-intermediate-size", "24",
       "--moe-grouped-gemm"]
LAYOUTS = {
    "one": (1, []),
    "d2": (2, []),
    "d2_distopt": (2, ["--use-distributed-optimizer"]),
    "p2_1f1b": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b"]),
    "p2_zbv": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv"]),
    "recompute": (1, ["--recompute-granularity", "full"]),
    "t2": (2, ["--tensor-model-parallel-size", "2"]),  # attention split, the MoE layer replicated
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("moe"), LAYOUTS, base=[*TINY, *MOE])


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "one"])
def test_moe_layout_matches_one_process(runs, layout):
    assert_equivalent(runs[layout], runs["one"])
    for got, want in zip(runs[layout].records, runs["one"].records, strict=True):
        for key in ("moe_aux_loss", "moe_z_loss", "moe_max_load_ratio"):
            assert got[key] == pytest.approx(want[key], rel=1e-4), (layout, key)
        assert got["moe_dropped_tokens"] == want["moe_dropped_tokens"] == 0
