"""Pipeline parallelism composed with TP and DP trains the same model as one process: per iteration the
same loss and gradient norm, and the same weights at the end. Every layout runs in one spawn of 8
processes (``helpers.run_layouts``)."""

from __future__ import annotations

import pytest
from helpers import GLOBAL_BATCH, MICRO_BATCH, assert_equivalent, run_layouts

RTOL = 1e-4
M = GLOBAL_BATCH // MICRO_BATCH  # microbatches per iteration at d = 1


def layout(t: int, p: int, v: int, schedule: str) -> list[str]:
    return ["--tensor-model-parallel-size", str(t), "--pipeline-model-parallel-size", str(p),
            "--virtual-pipeline-model-parallel-size", str(v), "--pipeline-schedule", schedule]


LAYOUTS = [  # (t, p, d, v, schedule); (1, 2, 1, 2, interleaved) is the --num-layers-per-virtual-pipeline-stage run
    (1, 2, 1, 1, "gpipe"),
    (1, 2, 1, 1, "1f1b"),
    (2, 2, 2, 2, "interleaved"),
    (1, 2, 2, 1, "1f1b"),
]
PLAN = {
    **{f"t{t}p{p}d{d}v{v}-{s}": (t * p * d, layout(t, p, v, s)) for t, p, d, v, s in LAYOUTS},
    # p=4, v=2, 8 layers: rank 0 holds layers 0 and 4 (the paper's Figure 4 assignment)
    "p4v2-8-layers": (4, ["--num-layers", "8", "--pipeline-model-parallel-size", "4",
                          "--virtual-pipeline-model-parallel-size", "2"]),
    "t2p2-no-scatter-gather": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                   "--no-scatter-gather-tensors-in-pipeline"]),
    "p2-layers-per-virtual-stage": (2, ["--pipeline-model-parallel-size", "2",
                                        "--num-layers-per-virtual-pipeline-stage", "1"]),
}


def _fraction(ratio: float) -> float:
    """The metrics' bubble fraction (idle over the schedule's time) of the paper's idle over ideal time."""
    return ratio / (1 + ratio)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("pipeline"), PLAN)


@pytest.mark.parametrize("t,p,d,v,schedule", LAYOUTS)
def test_pipeline_layouts_match_single_process(runs, reference, t, p, d, v, schedule):
    records = runs[f"t{t}p{p}d{d}v{v}-{schedule}"]
    assert_equivalent(records, reference, RTOL)
    m = M // d
    assert records.records[-1]["bubble_fraction_formula"] == pytest.approx(_fraction((p - 1) / (v * m)))
    assert all(0 <= r["bubble_fraction"] <= 1 for r in records.records if "bubble_fraction" in r)


def test_interleaved_four_stages_two_chunks(runs, reference_8_layers):
    got = runs["p4v2-8-layers"]
    assert_equivalent(got, reference_8_layers, RTOL)
    assert got.records[-1]["bubble_fraction_formula"] == pytest.approx(_fraction(3 / (2 * M)))


def test_scatter_gather_off_gives_same_training(runs, reference):
    assert_equivalent(runs["t2p2-no-scatter-gather"], reference, RTOL)


def test_megatron_layers_per_virtual_stage_flag(runs, reference):
    got = runs["p2-layers-per-virtual-stage"]
    assert_equivalent(got, reference, RTOL)
    assert got.records[-1]["bubble_fraction_formula"] == pytest.approx(_fraction(1 / (2 * M)))  # v = 4 / (1 * 2) = 2


@pytest.mark.parametrize("schedule,expected", [("gpipe", M), ("1f1b", 2)])
def test_activation_memory_in_flight(runs, schedule, expected):
    """GPipe stashes all m = 4 microbatches; 1F1B at most p = 2 (paper §2.2)."""
    for record in runs[f"t1p2d1v1-{schedule}"].records:
        assert record["peak_in_flight_microbatches"] == expected
        assert record["peak_activation_bytes"] > 0
