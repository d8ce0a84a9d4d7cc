"""Pipeline parallelism composed with TP and DP trains the same model as one process."""

from __future__ import annotations

import pytest
from helpers import losses, train_metrics

RTOL = 1e-4


@pytest.fixture(scope="module")
def reference_8_layers(tmp_path_factory):
    return losses(train_metrics(tmp_path_factory.mktemp("ref8"), 1, ["--num-layers", "8"]))


LAYOUTS = [  # (t, p, d, v, schedule)
    (1, 2, 1, 1, "gpipe"),
    (1, 2, 1, 1, "1f1b"),
    (2, 2, 2, 2, "interleaved"),
    (1, 2, 2, 1, "1f1b"),
    (1, 2, 1, 2, "interleaved"),
]


@pytest.mark.parametrize("t,p,d,v,schedule", LAYOUTS)
def test_pipeline_layouts_match_single_process(tmp_path, reference, t, p, d, v, schedule):
    extra = ["--tensor-model-parallel-size", str(t), "--pipeline-model-parallel-size", str(p),
             "--virtual-pipeline-model-parallel-size", str(v), "--pipeline-schedule", schedule]
    records = train_metrics(tmp_path, t * p * d, extra)
    assert losses(records) == pytest.approx(reference, rel=RTOL)
    m = 16 // (2 * d)
    assert records[-1]["bubble_fraction_formula"] == pytest.approx((p - 1) / (v * m))


def test_interleaved_four_stages_two_chunks(tmp_path, reference_8_layers):
    """p=4, v=2, 8 layers: rank 0 holds layers 0 and 4 (the paper's Figure 4 assignment)."""
    extra = ["--num-layers", "8", "--pipeline-model-parallel-size", "4",
             "--virtual-pipeline-model-parallel-size", "2"]
    records = train_metrics(tmp_path, 4, extra)
    assert losses(records) == pytest.approx(reference_8_layers, rel=RTOL)
    assert records[-1]["bubble_fraction_formula"] == pytest.approx(3 / (2 * 8))


def test_scatter_gather_off_gives_same_losses(tmp_path, reference):
    extra = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
             "--no-scatter-gather-tensors-in-pipeline"]
    assert losses(train_metrics(tmp_path, 4, extra)) == pytest.approx(reference, rel=RTOL)


def test_megatron_layers_per_virtual_stage_flag(tmp_path, reference):
    extra = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    records = train_metrics(tmp_path, 2, extra)
    assert losses(records) == pytest.approx(reference, rel=RTOL)
    assert records[-1]["bubble_fraction_formula"] == pytest.approx(1 / (2 * 8))  # v = 4 / (1 * 2) = 2


@pytest.mark.parametrize("schedule,expected", [("gpipe", 8), ("1f1b", 2)])
def test_activation_memory_in_flight(tmp_path, schedule, expected):
    """GPipe stashes all m microbatches; 1F1B at most p (paper §2.2)."""
    extra = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule, "--train-iters", "1"]
    records = train_metrics(tmp_path, 2, extra)
    assert records[0]["peak_in_flight_microbatches"] == expected
    assert records[0]["peak_activation_bytes"] > 0
