"""Schedules as data: completeness, ordering, send/recv matching, deadlock freedom, memory and bubble."""

from __future__ import annotations

from collections import Counter

import pytest

from ptdp.pipeline.schedules import (
    SCHEDULES,
    Action,
    bubble_fraction_formula,
    build_schedule,
    check_deadlock_free,
    compute_only,
    compute_times,
    interleaved_warmup,
    peak_in_flight,
    stage_peers,
    virtual_stage,
)

V1 = [(p, m) for p in (1, 2, 3, 4, 8) for m in sorted({1, 2, max(1, p - 1), p, p + 1, 2 * p, 3 * p + 1})]
INTERLEAVED = [(p, v, m) for p in (1, 2, 3, 4, 8) for v in (1, 2, 3) for m in (p, 2 * p, 3 * p)]
CASES = (
    [("gpipe", p, 1, m) for p, m in V1]
    + [("1f1b", p, 1, m) for p, m in V1]
    + [("zb-h1", p, 1, m) for p, m in V1]
    + [("interleaved", p, v, m) for p, v, m in INTERLEAVED]
)
IDS = [f"{n}-p{p}-v{v}-m{m}" for n, p, v, m in CASES]


def all_ranks(name: str, p: int, v: int, m: int) -> list[list[Action]]:
    return [build_schedule(name, p, v, m, r) for r in range(p)]


@pytest.mark.parametrize("name,p,v,m", CASES, ids=IDS)
def test_every_pair_forwarded_and_backwarded_once_in_order(name, p, v, m):
    for rank, actions in enumerate(all_ranks(name, p, v, m)):
        ops = Counter((a.op, a.microbatch, a.chunk) for a in compute_only(actions))
        backward_ops = ("I", "W") if name == "zb-h1" else ("B",)
        expected = Counter({(op, mb, c): 1 for op in ("F", *backward_ops) for mb in range(m) for c in range(v)})
        assert ops == expected, f"rank {rank}"
        position = {(a.op, a.microbatch, a.chunk): i for i, a in enumerate(actions) if a.op in ("F", "B", "I", "W")}
        for mb in range(m):
            for c in range(v):
                assert position["F", mb, c] < position[backward_ops[0], mb, c]
                if name == "zb-h1":
                    assert position["I", mb, c] < position["W", mb, c]


@pytest.mark.parametrize("name,p,v,m", CASES, ids=IDS)
def test_sends_match_receives_and_never_deadlock(name, p, v, m):
    schedules = all_ranks(name, p, v, m)
    sent, received = Counter(), Counter()
    for rank, actions in enumerate(schedules):
        for a in actions:
            s = virtual_stage(rank, a.chunk, p)
            if a.op == "SEND_F":
                sent["F", a.microbatch, s + 1, rank, a.peer] += 1
            elif a.op == "SEND_B":
                sent["B", a.microbatch, s - 1, rank, a.peer] += 1
            elif a.op.startswith("RECV"):
                received[a.op[-1], a.microbatch, s, a.peer, rank] += 1
    assert sent == received
    assert all(n == 1 for n in sent.values())
    # one message per stage boundary crossing ranks, each way, per microbatch
    boundaries = p * v - 1 if p > 1 else 0
    assert sum(sent.values()) == 2 * m * boundaries
    check_deadlock_free(schedules, p, v)


@pytest.mark.parametrize("v,m", [(1, 4), (3, 2)])
def test_single_rank_has_no_communication(v, m):
    name = "1f1b" if v == 1 else "interleaved"
    assert all(a.op in ("F", "B") for a in build_schedule(name, 1, v, m, 0))


def test_deadlock_checker_catches_a_bad_order():
    # rank 0 waits for a gradient before sending the activation that produces it
    bad = [
        [Action("RECV_B", 0, 0, 1), Action("F", 0, 0), Action("SEND_F", 0, 0, 1), Action("B", 0, 0)],
        [Action("RECV_F", 0, 0, 0), Action("F", 0, 0), Action("B", 0, 0), Action("SEND_B", 0, 0, 0)],
    ]
    with pytest.raises(AssertionError, match="deadlock"):
        check_deadlock_free(bad, 2, 1)
    swapped = [build_schedule("gpipe", 2, 1, 2, 0), build_schedule("gpipe", 2, 1, 2, 1)]
    swapped[1][0], swapped[1][2] = swapped[1][2], swapped[1][0]  # receives out of FIFO order
    with pytest.raises(AssertionError, match="matched message"):
        check_deadlock_free(swapped, 2, 1)


@pytest.mark.parametrize("p,m", V1)
def test_peak_in_flight(p, m):
    for rank in range(p):
        assert peak_in_flight(build_schedule("gpipe", p, 1, m, rank)) == m
        assert peak_in_flight(build_schedule("1f1b", p, 1, m, rank)) == min(p - rank, m)
        assert peak_in_flight(build_schedule("zb-h1", p, 1, m, rank)) == min(p - rank, m)


@pytest.mark.parametrize("p,v,m", INTERLEAVED)
def test_interleaved_follows_megatron(p, v, m):
    for rank in range(p):
        compute = compute_only(build_schedule("interleaved", p, v, m, rank))
        forwards_before_first_b = next(i for i, a in enumerate(compute) if a.op == "B")
        warmup = m * v if m == p else min((p - rank - 1) * 2 + (v - 1) * p, m * v)
        assert interleaved_warmup(p, v, m, rank) == warmup
        assert forwards_before_first_b == min(warmup + 1, m * v)  # steady state starts with a forward
        forwards = [a for a in compute if a.op == "F"]
        backwards = [a for a in compute if a.op == "B"]
        for k, (f, b) in enumerate(zip(forwards, backwards)):  # groups of p microbatches per chunk
            group_chunk = (k % (p * v)) // p
            assert (f.chunk, f.microbatch) == (group_chunk, (k // (p * v)) * p + k % p)
            assert (b.chunk, b.microbatch) == (v - 1 - group_chunk, f.microbatch)
        # the stash never exceeds warm-up + 1 (the steady state holds one extra forward)
        assert peak_in_flight(compute) == min(warmup + 1, m * v)


def makespan(schedules: list[list[Action]], p: int, v: int, t_f: float, t_b: float) -> float:
    """Unit-cost timing with free communication: each rank runs its list in order, waiting for inputs."""
    durations = {"F": t_f / v, "B": t_b / v, "I": t_b / (2 * v), "W": t_b / (2 * v)}
    times = compute_times([compute_only(s) for s in schedules], p, v, durations)
    return max(end for row in times for _, end in row)


@pytest.mark.parametrize("name,p,v,m", [c for c in CASES if c[0] != "zb-h1"], ids=[
    i for c, i in zip(CASES, IDS) if c[0] != "zb-h1"])
def test_bubble_matches_formula(name, p, v, m):
    """Ideal time (m + (p-1)/v)(t_f + t_b), i.e. bubble fraction (p-1)/(v m) (ptdp-facts.md, §Schedules)."""
    t_f, t_b = 1.0, 2.0
    ideal = m * (t_f + t_b) * (1 + bubble_fraction_formula(p, v, m))
    assert makespan(all_ranks(name, p, v, m), p, v, t_f, t_b) == pytest.approx(ideal)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (4, 12), (8, 16)])
def test_zero_bubble_h1_cuts_the_bubble_to_a_third(p, m):
    """ZB-H1 bubble (p-1)(t_f + t_i - t_w) vs 1F1B's (p-1)(t_f + t_b), with t_i = t_w = t_b / 2."""
    t_f, t_b = 1.0, 2.0
    compute = m * (t_f + t_b)
    assert makespan(all_ranks("1f1b", p, 1, m), p, 1, t_f, t_b) - compute == pytest.approx((p - 1) * (t_f + t_b))
    assert makespan(all_ranks("zb-h1", p, 1, m), p, 1, t_f, t_b) - compute == pytest.approx((p - 1) * t_f)


def test_bubble_fraction_formula():
    assert bubble_fraction_formula(4, 1, 8) == pytest.approx(3 / 8)
    assert bubble_fraction_formula(4, 2, 8) == pytest.approx(3 / 16)
    assert bubble_fraction_formula(1, 1, 5) == 0


def test_stage_helpers():
    assert virtual_stage(0, 1, 4) == 4 and virtual_stage(3, 0, 4) == 3
    assert stage_peers(0, 0, 4, 2) == (None, 1)
    assert stage_peers(0, 1, 4, 2) == (3, 1)
    assert stage_peers(3, 1, 4, 2) == (2, None)
    assert stage_peers(0, 0, 1, 2) == (None, 0)


@pytest.mark.parametrize("name,p,v,m,match", [
    ("gpipe", 4, 2, 8, "v=1"),
    ("1f1b", 4, 2, 8, "v=1"),
    ("interleaved", 4, 2, 6, "--global-batch-size"),
    ("interleaved", 4, 2, 0, "--micro-batch-size"),
    ("1f1b", 4, 1, 8, "rank"),
    ("nope", 4, 1, 8, "choose one of"),
])
def test_bad_arguments_raise_clear_errors(name, p, v, m, match):
    rank = 4 if match == "rank" else 0
    with pytest.raises(ValueError, match=match):
        build_schedule(name, p, v, m, rank)


def test_registry():
    assert {"gpipe", "1f1b", "interleaved"} <= set(SCHEDULES)
