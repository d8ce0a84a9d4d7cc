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

from ptdp.schedule.registry import SCHEDULES, schedule_placement
from ptdp.simulate.nccl.experts import record_expert_trace
from ptdp.simulate.nccl.model import SEND_MODELS, check_all_send_models, check_trace

STRICT = "sends wait for their receive"


def problems(trace: dict, both_send_models: bool = True) -> list[str]:
    """Under both send models, or the strict one alone, which implies the other (test_nccl_model's
    ``assert_deadlock_free`` says why; a collective's completion does not depend on the send model)."""
    models = check_all_send_models(trace) if both_send_models else {STRICT: check_trace(trace, SEND_MODELS[STRICT])}
    return [f"{model}: {line}" for model, found in models.items() for line in found]


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
                        found = problems(trace, both_send_models=p == 2)
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


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_zero_gathers_and_reductions_over_both_groups_with_expert_collectives_are_deadlock_free(name):
    """ZeRO-3 over a MoE model: each chunk's gathers and reductions on the dense DP communicator and on the
    expert-DP one (four pipelines, e = 2: two ep groups and two edp groups per stage), between the
    pipeline's p2p and inside the expert-parallel exchanges, with and without resharding after forward;
    ZeRO-2's reductions alone."""
    for p in (2, 4):
        for v in (2,) if name == "interleaved" or schedule_placement(name) == "v" else (1,):
            for m in microbatch_counts(name, p)[:2]:
                for zero, forward_only, reshard, recompute in (
                        ("optim_grads_params", False, False, False), ("optim_grads_params", False, True, True),
                        ("optim_grads_params", True, True, False), ("optim_grads", False, False, True)):
                    trace = record_expert_trace(name, p, v, m, pipelines=4, e=2, moe_layers=2, recompute=recompute,
                                                forward_only=forward_only, zero=zero, reshard_after_forward=reshard)
                    found = problems(trace)
                    assert not found, (name, p, v, m, zero, forward_only, reshard, found[:2])


def test_zero3_collectives_are_in_the_trace_on_both_groups():
    trace = record_expert_trace("1f1b", 2, 1, 2, pipelines=4, e=2, zero="optim_grads_params")
    rank2 = trace["ranks"][2]  # pipeline 1, stage 0: ep rank 1, edp rank 0
    colls = [(e["comm"], op["group"], op["msg"][0]) for e in rank2 for op in e.get("issue", ()) if op["op"] == "coll"]
    assert colls == [("dp", [0, 2, 4, 6], "all_gather"), ("edp", [2, 6], "all_gather"),
                     ("dp", [0, 2, 4, 6], "reduce_scatter"), ("edp", [2, 6], "reduce_scatter")]
    ep = {op["peer"] for e in rank2 if e.get("comm") == "ep" for op in e["issue"]}
    assert ep == {0}  # its expert-parallel peer: pipeline 0's stage 0
    one_group = record_expert_trace("1f1b", 2, 1, 2, pipelines=2, e=2, zero="optim_grads_params")  # edp = 1: dense only
    assert {e["comm"] for e in one_group["ranks"][0] if "comm" in e} == {"F", "B", "ep", "dp"}
    stage2 = record_expert_trace("1f1b", 2, 1, 2, pipelines=4, e=2, zero="optim_grads")
    assert [op["msg"][0] for e in stage2["ranks"][2] for op in e.get("issue", ()) if op["op"] == "coll"] == \
        ["reduce_scatter", "reduce_scatter"]


def test_an_expert_dp_peer_out_of_order_deadlocks():
    trace = record_expert_trace("1f1b", 2, 1, 4, pipelines=4, e=2, zero="optim_grads_params")
    late = trace["ranks"][6]  # pipeline 3, stage 0: issues its first expert-DP gather last
    first = next(k for k, e in enumerate(late) if e.get("comm") == "edp")
    late.append(late.pop(first))
    found = problems(trace)
    assert any("deadlock" in line or "mismatch" in line for line in found), found
