"""Schedules as data: completeness, ordering, send/recv matching, deadlock freedom, memory and bubble."""

from __future__ import annotations

from collections import Counter

import pytest

from ptdp.schedule.actions import (
    Action,
    compute_only,
    peak_in_flight,
    peak_stashed,
    stage_location,
    stage_peers,
    virtual_stage,
)
from ptdp.schedule.builders import interleaved_warmup
from ptdp.schedule.communication import check_deadlock_free, compute_times
from ptdp.schedule.registry import SCHEDULES, bubble_fraction_formula, build_schedule, schedule_placement

V1 = [(p, m) for p in (1, 2, 3, 4, 8) for m in sorted({1, 2, max(1, p - 1), p, p + 1, 2 * p, 3 * p + 1})]
INTERLEAVED = [(p, v, m) for p in (1, 2, 3, 4, 8) for v in (1, 2, 3) for m in (p, 2 * p, 3 * p)]
CASES = (
    [("gpipe", p, 1, m) for p, m in V1]
    + [("1f1b", p, 1, m) for p, m in V1]
    + [("zb-h1", p, 1, m) for p, m in V1]
    + [("zb-h2", p, 1, m) for p, m in V1]
    + [(name, p, 2, m) for name in ("zbv", "v-half", "v-min") for p, m in V1]
    + [("interleaved", p, v, m) for p, v, m in INTERLEAVED]
)
SPLIT = {"zb-h1", "zb-h2", "zbv", "v-half", "v-min"}  # backward split into I and W
IDS = [f"{n}-p{p}-v{v}-m{m}" for n, p, v, m in CASES]


def all_ranks(name: str, p: int, v: int, m: int) -> list[list[Action]]:
    return [build_schedule(name, p, v, m, r) for r in range(p)]


@pytest.mark.parametrize("name,p,v,m", CASES, ids=IDS)
def test_every_pair_forwarded_and_backwarded_once_in_order(name, p, v, m):
    for rank, actions in enumerate(all_ranks(name, p, v, m)):
        ops = Counter((a.op, a.microbatch, a.chunk) for a in compute_only(actions))
        backward_ops = ("I", "W") if name in SPLIT else ("B",)
        expected = Counter({(op, mb, c): 1 for op in ("F", *backward_ops) for mb in range(m) for c in range(v)})
        assert ops == expected, f"rank {rank}"
        position = {(a.op, a.microbatch, a.chunk): i for i, a in enumerate(actions) if a.op in ("F", "B", "I", "W")}
        for mb in range(m):
            for c in range(v):
                assert position["F", mb, c] < position[backward_ops[0], mb, c]
                if name in SPLIT:
                    assert position["I", mb, c] < position["W", mb, c]


@pytest.mark.parametrize("name,p,v,m", CASES, ids=IDS)
def test_sends_match_receives_and_never_deadlock(name, p, v, m):
    schedules = all_ranks(name, p, v, m)
    placement = schedule_placement(name)
    sent, received = Counter(), Counter()
    for rank, actions in enumerate(schedules):
        for a in actions:
            s = virtual_stage(rank, a.chunk, p, placement)
            if a.op == "SEND_F":
                sent["F", a.microbatch, s + 1, rank, a.peer] += 1
            elif a.op == "SEND_B":
                sent["B", a.microbatch, s - 1, rank, a.peer] += 1
            elif a.op.startswith("RECV"):
                received[a.op[-1], a.microbatch, s, a.peer, rank] += 1
    assert sent == received
    assert all(n == 1 for n in sent.values())
    # one message per stage boundary crossing ranks, each way, per microbatch (in a V the turn at the
    # bottom, stage p-1 to p, stays on rank p-1)
    boundaries = sum(stage_location(s, p, placement)[0] != stage_location(s + 1, p, placement)[0]
                     for s in range(p * v - 1))
    assert sum(sent.values()) == 2 * m * boundaries
    check_deadlock_free(schedules, p, v, placement)


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


def makespan(schedules: list[list[Action]], p: int, v: int, t_f: float, t_b: float, placement: str = "loop"
             ) -> float:
    """Unit-cost timing with free communication: each rank runs its list in order, waiting for inputs."""
    durations = {"F": t_f / v, "B": t_b / v, "I": t_b / (2 * v), "W": t_b / (2 * v)}
    times = compute_times([compute_only(s) for s in schedules], p, v, durations, placement)
    return max(end for row in times for _, end in row)


@pytest.mark.parametrize("name,p,v,m", CASES, ids=IDS)
def test_bubble_matches_formula(name, p, v, m):
    """Ideal time (m + (p-1)/v)(t_f + t_b), i.e. bubble fraction (p-1)/(v m) (docs/references.md, §Schedules);
    for the zero-bubble family the schedule's own formula at t_i = t_w = t_b / 2."""
    t_f, t_b = 1.0, 2.0
    ideal = m * (t_f + t_b) * (1 + bubble_fraction_formula(p, v, m, name))
    assert makespan(all_ranks(name, p, v, m), p, v, t_f, t_b, schedule_placement(name)) == pytest.approx(ideal)


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
    ("interleaved", 4, 2, 6, "m=6 to be a multiple of p=4"),
    ("interleaved", 4, 2, 0, "at least 1 microbatch"),
    ("1f1b", 4, 1, 8, "rank"),
    ("zbv", 4, 1, 8, "2 model chunk"),
    ("zb-h2", 4, 2, 8, "1 model chunk"),
    ("nope", 4, 1, 8, "choose one of"),
])
def test_bad_arguments_raise_clear_errors(name, p, v, m, match):
    rank = 4 if match == "rank" else 0
    with pytest.raises(ValueError, match=match):
        build_schedule(name, p, v, m, rank)


def test_v_placement():
    """Rank r holds stages r and 2p-1-r: the first and last stage share rank 0, the turn is on rank p-1."""
    assert [virtual_stage(r, c, 4, "v") for r in range(4) for c in (0, 1)] == [0, 7, 1, 6, 2, 5, 3, 4]
    assert all(stage_location(virtual_stage(r, c, 4, "v"), 4, "v") == (r, c) for r in range(4) for c in (0, 1))
    assert stage_peers(0, 0, 4, 2, "v") == (None, 1) and stage_peers(0, 1, 4, 2, "v") == (1, None)
    assert stage_peers(3, 0, 4, 2, "v") == (2, 3) and stage_peers(3, 1, 4, 2, "v") == (3, 2)
    assert {n: schedule_placement(n) for n in ("1f1b", "zb-h2", "zbv", "v-half", "v-min")} == {
        "1f1b": "loop", "zb-h2": "loop", "zbv": "v", "v-half": "v", "v-min": "v"}


@pytest.mark.parametrize("p,m", [(4, 8), (4, 16), (8, 16)])
def test_zero_bubble_trade_offs(p, m):
    """The papers' claims at t_F = t_B = t_W, in activation stashes against 1F1B (a V chunk is half a
    rank's layers) and in bubble: ZB-H1 1x memory, a third of 1F1B's bubble; ZB-H2 under 2x; ZB-V 1x and
    the least bubble; V-Half about 1/2 the memory and less bubble than 1F1B; V-Min less memory still."""
    def memory(name: str) -> float:
        v = 2 if schedule_placement(name) == "v" else 1
        return max(peak_stashed(build_schedule(name, p, v, m, r)) for r in range(p)) / v

    def bubble(name: str) -> float:
        return bubble_fraction_formula(p, 2 if schedule_placement(name) == "v" else 1, m, name)

    base = memory("1f1b")
    assert memory("zb-h1") == base and memory("zbv") == base
    assert base < memory("zb-h2") < 2 * base
    assert memory("v-half") <= 0.5 * base
    assert memory("v-min") <= memory("v-half") and (p < 8 or memory("v-min") < 0.4 * base)
    assert bubble("zb-h1") == pytest.approx((p - 1) / (3 * m))
    assert bubble("zbv") < bubble("zb-h1") < bubble("1f1b") == pytest.approx((p - 1) / m)
    assert bubble("zb-h2") <= bubble("zb-h1")
    assert bubble("v-half") < bubble("1f1b")


def test_registry():
    assert {"gpipe", "1f1b", "interleaved"} <= set(SCHEDULES)
