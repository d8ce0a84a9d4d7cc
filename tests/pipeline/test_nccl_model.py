"""The NCCL model check: the calls the real executor makes are deadlock-free under NCCL's p2p ordering.

The grid is every schedule, every p <= 16, every v <= 4 the schedule takes (two chunks in a V for zbv,
v-half and v-min), microbatch counts around the
warm-up boundaries, training and forward-only, both send models, per-direction communicators (and a single
one up to p = 8). A deliberately unsafe policy (receives
posted ahead of the compute before their consumer, as ptdp's executor did before) must fail the check, and
so must a trace with a receive out of FIFO order, a missing send, or a compute that reads an unwaited
receive: the check can fail.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ptdp.schedule.actions import COMPUTE_OPS, Action
from ptdp.schedule.registry import REGISTRY, SCHEDULES, build_schedule, schedule_placement
from ptdp.simulate.nccl.model import SEND_MODELS, check_all_send_models, check_trace, record_comm_trace


def microbatch_counts(name: str, p: int) -> list[int]:
    if name == "interleaved":
        return [p, 2 * p] + ([3 * p] if p <= 8 else [])
    counts = {1, 2, max(1, p - 1), p, p + 1, 2 * p, 2 * p + 1} | ({3 * p + 1} if p <= 8 else set())
    return sorted(m for m in counts if REGISTRY[name].takes_microbatches(p, m))  # dualpipev: m >= 2p


STRICT = "sends wait for their receive"


def assert_deadlock_free(trace: dict, both_send_models: bool = True) -> None:
    """Under both send models, or (``both_send_models=False``) the strict one alone, which implies the other:
    every condition of ``check_trace``'s play is monotone (an operation done only adds progress) and a send
    completing on its own is done whenever it is under the strict model, while the other checks (matched
    messages, waited receives) do not depend on the send model -- so a trace deadlock-free when sends wait
    for their receive is deadlock-free when they do not (the sweep below checks both on small p)."""
    models = check_all_send_models(trace) if both_send_models else {
        STRICT: check_trace(trace, SEND_MODELS[STRICT])}
    for model, problems in models.items():
        assert not problems, f"{trace['schedule']} p={trace['p']} v={trace['v']} m={trace['m']} " \
                             f"forward_only={trace['forward_only']} ({model}): {problems[:3]}"


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("p", range(2, 17))
def test_every_schedule_is_deadlock_free_under_nccl(name, p):
    """With one communicator per direction (what training uses) and, up to p = 8, with one for both (the
    model's classic case); both send models up to p = 3, the strict one (which implies the other,
    ``assert_deadlock_free``) beyond."""
    seen = set()  # forward-only lists of the v=1 schedules coincide: check each distinct list once
    for v in (1, 2, 3, 4) if name == "interleaved" else (2,) if schedule_placement(name) == "v" else (1,):
        for m in microbatch_counts(name, p):
            for forward_only in (False, True):
                lists = [build_schedule(name, p, v, m, r, forward_only) for r in range(p)]
                key = (v, m, repr(lists))
                if key in seen:
                    continue
                seen.add(key)
                for per_direction in (False, True) if p <= 8 else (True,):
                    assert_deadlock_free(record_comm_trace(name, p, v, m, forward_only, lists, per_direction),
                                         both_send_models=p <= 3)


def hoist_receives(actions: list[Action], lookahead: int) -> list[Action]:
    """The old policy: each receive posted ``lookahead`` computes before its consumer, batched with the
    sends of that point."""
    compute_index = [i for i, a in enumerate(actions) if a.op in COMPUTE_OPS]
    out: dict[int, list[Action]] = {}
    for i, a in enumerate(actions):
        if a.op.startswith("RECV"):
            consumer = next(k for k, j in enumerate(compute_index) if j > i)
            target = compute_index[max(0, consumer - lookahead)]
            out.setdefault(target, []).append(a)
    result = []
    for i, a in enumerate(actions):
        if a.op.startswith("RECV"):
            continue
        if i in out:  # after the sends that precede this compute, in one batch
            result += out[i]
        result.append(a)
    return result


@pytest.mark.parametrize("name,v,m", [("1f1b", 1, 2), ("gpipe", 1, 4), ("interleaved", 2, 4), ("zb-h1", 1, 4)])
def test_posting_receives_early_deadlocks(name, v, m):
    p = 2
    lists = [hoist_receives(build_schedule(name, p, v, m, r), 2) for r in range(p)]
    problems = check_trace(record_comm_trace(name, p, v, m, lists=lists), sends_wait_for_receive=False)
    assert any(problem.startswith("deadlock") for problem in problems), problems


def test_smallest_case_of_the_old_hang_names_the_stuck_ranks():
    """1f1b p=2 m=2: rank 0 posted [recv B0] before computing F0, so [send F0] queued behind it."""
    lists = [hoist_receives(build_schedule("1f1b", 2, 1, 2, r), 2) for r in range(2)]
    problems = check_trace(record_comm_trace("1f1b", 2, 1, 2, lists=lists), sends_wait_for_receive=False)
    assert any("rank 0" in x and "gradient B0 of stage 1 from rank 1" in x for x in problems), problems
    assert any("rank 1" in x for x in problems), problems


def test_interleaved_needs_combined_batches_when_sends_wait():
    """Receives posted only by their consumer (lookahead 0), sends right after their producer: interleaved
    deadlocks once a send waits for its receive, not while sends are buffered."""
    p, v, m = 4, 2, 8

    lists = [_receive_at_consumer(build_schedule("interleaved", p, v, m, r)) for r in range(p)]
    trace = record_comm_trace("interleaved", p, v, m, lists=lists)
    assert check_trace(trace, sends_wait_for_receive=False) == []
    assert any(x.startswith("deadlock") for x in check_trace(trace, sends_wait_for_receive=True))


def _receive_at_consumer(actions: list[Action]) -> list[Action]:
    out, waiting = [], []
    for a in actions:
        if a.op.startswith("RECV"):
            waiting.append(a)
            continue
        if a.op in COMPUTE_OPS:
            key = ("F" if a.op == "F" else "B", a.microbatch, a.chunk)
            mine = [r for r in waiting if (r.op[-1], r.microbatch, r.chunk) == key]
            waiting = [r for r in waiting if r not in mine]
            out += mine
        out.append(a)
    return out


def test_fifo_mismatch_missing_send_and_unwaited_receive_are_reported():
    trace = record_comm_trace("gpipe", 2, 1, 2)
    rank1 = trace["ranks"][1]
    issues = [i for i, e in enumerate(rank1) if "issue" in e]
    swapped = json.loads(json.dumps(trace))
    a, b = issues[0], issues[1]
    swapped["ranks"][1][a], swapped["ranks"][1][b] = rank1[b], rank1[a]
    assert any(x.startswith("mismatch") for x in check_trace(swapped, False))

    missing = json.loads(json.dumps(trace))
    missing["ranks"][0] = [e for e in missing["ranks"][0] if "issue" not in e or e["issue"][0]["msg"][1] != 1]
    missing["ranks"][0] = [e if "wait" not in e else {"wait": min(e["wait"], 1)} for e in missing["ranks"][0]]
    assert any(x.startswith(("unmatched", "deadlock")) for x in check_trace(missing, False))

    unwaited = json.loads(json.dumps(trace))
    unwaited["ranks"][1] = [e for e in unwaited["ranks"][1] if "wait" not in e]
    assert any(x.startswith("race") for x in check_trace(unwaited, False))


def test_simulate_comm_trace_cli(tmp_path):
    out = tmp_path / "trace.json"
    cmd = [sys.executable, "-m", "ptdp", "simulate", "--pipeline-schedule", "interleaved",
           "--pipeline-model-parallel-size", "4", "--virtual-pipeline-model-parallel-size", "2",
           "--num-microbatches", "8", "--comm-trace", str(out)]
    for extra in ([], ["--forward-only"]):
        run = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert "deadlock-free" in run.stdout
        trace = json.loads(out.read_text())
        assert {k: trace[k] for k in ("schedule", "p", "v", "m", "forward_only")} == {
            "schedule": "interleaved", "p": 4, "v": 2, "m": 8, "forward_only": bool(extra)}
        assert len(trace["ranks"]) == 4
        kinds = {next(iter(e)) for events in trace["ranks"] for e in events}
        assert kinds == {"issue", "wait", "compute"}
        assert check_all_send_models(trace) == {k: [] for k in check_all_send_models(trace)}


def test_per_direction_communicators_are_separate_streams_and_channels():
    """With a communicator per direction a send of activations does not queue behind a send of
    gradients. The old hoisted-receive hang (rank 0 posts [recv B0] before F0's [send F0]) is a deadlock
    on one communicator and none on two; FIFO matching is per communicator."""
    lists = [hoist_receives(build_schedule("1f1b", 2, 1, 2, r), 2) for r in range(2)]
    one = record_comm_trace("1f1b", 2, 1, 2, lists=lists)
    two = record_comm_trace("1f1b", 2, 1, 2, lists=lists, per_direction=True)
    assert any(x.startswith("deadlock") for x in check_trace(one, sends_wait_for_receive=False))
    assert check_trace(two, sends_wait_for_receive=False) == []
    comms = {e.get("comm") for events in two["ranks"] for e in events if "issue" in e}
    assert comms == {"F", "B"}
    for events in two["ranks"]:  # every issue holds one direction only
        for e in events:
            if "issue" in e:
                assert {op["msg"][0] for op in e["issue"]} == {e["comm"]}
    relabelled = json.loads(json.dumps(two))  # the same messages on the wrong communicator: unmatched
    for e in relabelled["ranks"][1]:
        if "issue" in e:
            e["comm"] = "F"
    assert any(x.startswith(("unmatched", "mismatch", "deadlock")) for x in check_trace(relabelled, False))
