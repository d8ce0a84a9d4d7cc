"""The planner's activation-memory model against what the pipeline runtime measures on real ranks."""

from __future__ import annotations

import pytest
from helpers import GLOBAL_BATCH, MICRO_BATCH, run_layouts

from ptdp.planner import activation_microbatches_in_flight

CASES = [("gpipe", 2, 1, 1), ("1f1b", 2, 1, 1), ("1f1b", 4, 1, 1), ("interleaved", 2, 2, 1), ("interleaved", 2, 2, 2)]


def _name(case: tuple[str, int, int, int]) -> str:
    return "{}-p{}v{}d{}".format(*case)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every case, one iteration each, in one ``run_layouts`` (the session's ranks)."""
    plan = {}
    for schedule, p, v, d in CASES:
        layers = p * v * (2 if p * v < 4 else 1)
        plan[_name((schedule, p, v, d))] = (p * d, [
            "--num-layers", str(layers), "--pipeline-model-parallel-size", str(p),
            "--virtual-pipeline-model-parallel-size", str(v), "--pipeline-schedule", schedule, "--train-iters", "1"])
    return run_layouts(tmp_path_factory.mktemp("in-flight"), plan, save=False)  # records only: no final save


@pytest.mark.parametrize("schedule,p,v,d", CASES)
def test_planner_in_flight_count_matches_runtime(runs, schedule, p, v, d):
    record = runs[_name((schedule, p, v, d))].records[0]
    m = GLOBAL_BATCH // (MICRO_BATCH * d)
    predicted = max(activation_microbatches_in_flight(schedule, p, v, m, r) for r in range(p))
    assert record["peak_in_flight_microbatches"] == predicted
