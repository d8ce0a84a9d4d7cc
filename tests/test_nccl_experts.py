"""The NCCL model check with the MoE layers' expert-parallel collectives inside every pipeline schedule.

Every schedule (p <= 4, microbatch counts around the warm-up boundary, training and forward-only), both
dispatchers, with and without full recomputation, two MoE layers per chunk, two and four pipelines that
share expert-parallel groups per stage (the folded layout), both send models: deadlock-free. An expert-
parallel group spanning two stages of one pipeline (a layout folding must never produce) deadlocks, so the
check can fail. With expert tensor parallelism under sequence parallelism (etp = t) the tokens are also
gathered and the output reduce-scattered over the expert-tensor group on a communicator of its own.
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
                    for dispatcher, recompute, pipelines, etp in (
                            ("alltoall", False, 2, False), ("allgather", True, 2, False), ("alltoall", True, 4, False),
                            ("allgather", True, 4, True)):
                        trace = record_expert_trace(name, p, v, m, pipelines=pipelines, moe_layers=2,
                                                    dispatcher=dispatcher, recompute=recompute,
                                                    forward_only=forward_only, expert_tensor=etp)
                        found = problems(trace)
                        assert not found, (name, p, v, m, forward_only, dispatcher, recompute, etp, found[:2])


def test_collectives_are_in_the_trace():
    trace = record_expert_trace("1f1b", 2, 1, 2, pipelines=2, moe_layers=1)
    ep = [e for e in trace["ranks"][0] if e.get("comm") == "ep"]
    # per microbatch: 3 forward collectives and 2 backward ones, each with the other pipeline's stage 0
    assert len(ep) == 2 * (3 + 2)
    assert {op["peer"] for e in ep for op in e["issue"]} == {2}


def test_expert_tensor_collectives_are_in_the_trace():
    """etp = t with SP at (t, e) = (2, 2) folded over 4 pipelines: per microbatch 3 + 1 collectives forward and
    1 + 2 backward with the TP peer on "etp", the dispatcher's with the expert-parallel peer on "ep"."""
    trace = record_expert_trace("1f1b", 2, 1, 2, pipelines=4, moe_layers=1, expert_tensor=True)
    etp = [e for e in trace["ranks"][0] if e.get("comm") == "etp"]
    ep = [e for e in trace["ranks"][0] if e.get("comm") == "ep"]
    assert len(etp) == 2 * (4 + 3) and {op["peer"] for e in etp for op in e["issue"]} == {2}
    assert len(ep) == 2 * (3 + 2) and {op["peer"] for e in ep for op in e["issue"]} == {4}


def test_an_expert_group_across_stages_deadlocks():
    trace = record_expert_trace("1f1b", 2, 1, 4, pipelines=1, moe_layers=1, ep_groups=[[0, 1]])
    found = problems(trace)
    assert any("deadlock" in line or "mismatch" in line for line in found), found
