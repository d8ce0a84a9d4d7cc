"""The NCCL model check with the MoE layers' expert-parallel collectives inside every pipeline schedule.

Every schedule (p <= 4, microbatch counts around the warm-up boundary, training and forward-only), both
dispatchers, with and without full recomputation, two MoE layers per chunk, two and four pipelines that
share expert-parallel groups per stage (the folded layout), both send models: deadlock-free. An expert-
parallel group spanning two stages of one pipeline (a layout folding must never produce) deadlocks, so the
check can fail.
"""

from __future__ import annotations

import pytest
from test_nccl_model import microbatch_counts

from ptdp.pipeline.nccl_experts import record_expert_trace
from ptdp.pipeline.nccl_model import check_all_send_models
from ptdp.pipeline.schedules import SCHEDULES, schedule_placement


def problems(trace: dict) -> list[str]:
    return [f"{model}: {line}" for model, found in check_all_send_models(trace).items() for line in found]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_with_expert_collectives_is_deadlock_free(name):
    for p in (2, 3, 4):
        for v in (1, 2) if name == "interleaved" else (2,) if schedule_placement(name) == "v" else (1,):
            for m in microbatch_counts(name, p)[:4]:
                for forward_only in (False, True):
                    for dispatcher, recompute, pipelines in (("alltoall", False, 2), ("allgather", True, 2),
                                                             ("alltoall", True, 4)):
                        trace = record_expert_trace(name, p, v, m, pipelines=pipelines, moe_layers=2,
                                                    dispatcher=dispatcher, recompute=recompute,
                                                    forward_only=forward_only)
                        found = problems(trace)
                        assert not found, (name, p, v, m, forward_only, dispatcher, recompute, found[:2])


def test_collectives_are_in_the_trace():
    trace = record_expert_trace("1f1b", 2, 1, 2, pipelines=2, moe_layers=1)
    ep = [e for e in trace["ranks"][0] if e.get("comm") == "ep"]
    # per microbatch: 3 forward collectives and 2 backward ones, each with the other pipeline's stage 0
    assert len(ep) == 2 * (3 + 2)
    assert {op["peer"] for e in ep for op in e["issue"]} == {2}


def test_an_expert_group_across_stages_deadlocks():
    trace = record_expert_trace("1f1b", 2, 1, 4, pipelines=1, moe_layers=1, ep_groups=[[0, 1]])
    found = problems(trace)
    assert any("deadlock" in line or "mismatch" in line for line in found), found
