"""Every (t, d) layout trains the same model as one process: per iteration the same loss and gradient
norm, and the same weights at the end, to fp32 tolerance."""

from __future__ import annotations

import pytest
from helpers import GLOBAL_BATCH, assert_equivalent, losses, run_layouts, train_metrics

RTOL = 1e-4  # fp32: TP splits sums across ranks, so the last bits differ
LAYOUTS = {f"t{t}d{d}": (t * d, ["--tensor-model-parallel-size", str(t)]) for t, d in [(2, 1), (4, 1), (1, 2), (2, 2)]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("layouts"), LAYOUTS)


@pytest.mark.parametrize("name", LAYOUTS)
def test_tensor_and_data_parallel_match_single_process(runs, reference, name):
    assert_equivalent(runs[name], reference, RTOL)


def test_metrics_records(reference):
    records = reference.records
    assert [r["iteration"] for r in records] == [1, 2, 3]
    for r in records:
        for key in ("loss", "lr", "grad_norm", "iteration_time_s", "tokens_per_s", "tflops_per_gpu"):
            assert isinstance(r[key], float), key
        assert r["tokens_per_s"] == pytest.approx(GLOBAL_BATCH * 16 / r["iteration_time_s"])


def test_dropout_on_still_trains(tmp_path):
    """With dropout, t=2 runs (different masks per TP rank inside attention) and the loss falls."""
    extra = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--train-iters", "30",
             "--lr", "3e-3", "--tensor-model-parallel-size", "2"]
    got = losses(train_metrics(tmp_path, 2, extra))
    assert sum(got[-5:]) / 5 < sum(got[:5]) / 5 - 0.3
