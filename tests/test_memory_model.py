"""The planner's activation-memory model against what the pipeline runtime measures on real ranks."""

from __future__ import annotations

import pytest
from helpers import train_metrics

from ptdp.planner import activation_microbatches_in_flight


@pytest.mark.parametrize("schedule,p,v,d", [("gpipe", 2, 1, 1), ("1f1b", 2, 1, 1), ("1f1b", 4, 1, 1),
                                            ("interleaved", 2, 2, 1), ("interleaved", 2, 2, 2)])
def test_planner_in_flight_count_matches_runtime(tmp_path, schedule, p, v, d):
    layers = p * v * (2 if p * v < 4 else 1)
    extra = ["--num-layers", str(layers), "--pipeline-model-parallel-size", str(p),
             "--virtual-pipeline-model-parallel-size", str(v), "--pipeline-schedule", schedule,
             "--train-iters", "1"]
    record = train_metrics(tmp_path, p * d, extra)[0]
    m = 16 // (2 * d)
    predicted = max(activation_microbatches_in_flight(schedule, p, v, m, r) for r in range(p))
    assert record["peak_in_flight_microbatches"] == predicted
