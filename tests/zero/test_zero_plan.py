"""Where ZeRO-3 gathers, frees and reduces (the actions ``ptdp.schedule.param_sync`` inserts), checked on every
schedule's action lists; the same collectives inside the schedules are deadlock-free under the NCCL model with two
data-parallel replicas (and the check fails on replicas that disagree); bad sharding flags are one line
each, exit 2."""

from __future__ import annotations

import pytest
from helpers import TINY, refused_in_process

from ptdp.config import add_config_arguments, config_from_args, validate
from ptdp.schedule.actions import COMM_OPS, COMPUTE_OPS, plain
from ptdp.schedule.param_sync import GATHER, PARAM_SYNC_OPS, REDUCE, RELEASE, WAIT, add_param_sync
from ptdp.schedule.registry import SCHEDULES, build_schedule, schedule_placement
from ptdp.simulate.nccl.model import check_all_send_models, check_trace
from ptdp.simulate.nccl.zero import record_zero_trace


def chunk_counts(name: str) -> tuple[int, ...]:
    return (1, 2, 3) if name == "interleaved" else (2,) if schedule_placement(name) == "v" else (1,)


def grid(max_p: int):
    for name in sorted(SCHEDULES):
        for p in range(1 if name in ("1f1b", "gpipe") else 2, max_p + 1):
            for v in chunk_counts(name):
                for m in sorted({p, 2 * p} if name == "interleaved" else {1, p, 2 * p + 1}):
                    try:
                        lists = [build_schedule(name, p, v, m, r) for r in range(p)]
                    except ValueError:
                        continue
                    yield name, p, v, m, lists


def comm_runs(actions) -> list[list]:
    """The runs of consecutive SEND/RECV actions."""
    runs, previous = [], False
    for a in actions:
        comm = a.op in COMM_OPS
        if comm and not previous:
            runs.append([])
        if comm:
            runs[-1].append(a)
        previous = comm
    return runs


def walk(actions) -> tuple[list[int], int]:
    """Play a list with ZeRO-3's actions: every compute runs on gathered weights of a chunk not yet reduced,
    every wait follows its gather, everything is freed at the end; (the reduced chunks in order, gathers)."""
    in_flight, gathered, reduced, gathers = set(), set(), [], 0
    for a in actions:
        if a.op == GATHER:
            assert a.chunk not in gathered | in_flight, a
            in_flight.add(a.chunk)
            gathers += 1
        elif a.op == WAIT:
            assert a.chunk in in_flight, a  # always prefetched or issued just now
            in_flight.discard(a.chunk)
            gathered.add(a.chunk)
        elif a.op == RELEASE:
            gathered.remove(a.chunk)
        elif a.op == REDUCE:
            reduced.append(a.chunk)
        elif a.op not in COMM_OPS:
            for part in a.parts:  # an overlapped pair (dualpipev) uses both its parts' chunks
                assert part.chunk in gathered, f"{a} runs on unsharded weights"
                assert part.chunk not in reduced, f"{a} after its chunk's gradients were reduced"
    assert not gathered and not in_flight  # everything freed at the end
    return reduced, gathers


@pytest.mark.parametrize("reshard", [False, True])
def test_plan_gathers_every_chunk_for_its_computes_and_reduces_after_its_last_weight_gradient(reshard):
    checked = 0
    for name, p, v, m, lists in grid(4):
        for actions in lists + [build_schedule(name, p, v, m, 0, forward_only=True)]:
            synced = add_param_sync(actions, reshard)
            assert [a for a in synced if a.op not in PARAM_SYNC_OPS] == actions, name  # only insertions
            reduced, gathers = walk(synced)
            grads = {a.chunk for a in plain(actions) if a.op in ("B", "I", "W")}
            assert sorted(reduced) == sorted(grads), (name, reduced)  # each chunk once; none forward-only
            if not reshard:
                assert gathers == len({a.chunk for a in actions if a.op in COMPUTE_OPS})  # once per step
            assert comm_runs(synced) == comm_runs(actions), name  # each SEND/RECV run stays one batched call
            checked += 1
    assert checked > 50


def test_reductions_overlap_the_rest_of_the_schedule():
    """With two chunks per rank, the first chunk whose gradients are final is reduced while the other
    still computes (zbv's rank 0: chunk 1 -- the last stage -- finishes first)."""
    for name, p, v in (("interleaved", 2, 2), ("zbv", 2, 2), ("zb-h1", 4, 1)):
        actions = add_param_sync(build_schedule(name, p, v, 2 * p, 0))
        compute = [i for i, a in enumerate(actions) if a.op in COMPUTE_OPS]
        first_reduce = min(i for i, a in enumerate(actions) if a.op == REDUCE)
        if v > 1:
            assert first_reduce < compute[-1], name
        else:
            assert first_reduce == compute[-1] + 1, name  # one chunk: right after its last W, the last compute


@pytest.mark.parametrize("reshard", [False, True])
def test_zero3_collectives_inside_every_schedule_are_deadlock_free_under_nccl(reshard):
    for name, p, v, m, _ in grid(5):
        for forward_only in (False, True):
            trace = record_zero_trace(name, p, v, m, reshard, replicas=2, forward_only=forward_only)
            assert any(op["op"] == "coll" for e in trace["ranks"][0] for op in e.get("issue", ()))
            for model, problems in check_all_send_models(trace).items():
                assert not problems, f"{name} p={p} v={v} m={m} reshard={reshard} ({model}): {problems[:3]}"


def test_the_check_fails_when_data_parallel_peers_disagree():
    trace = record_zero_trace("1f1b", 2, 1, 4, replicas=2)
    # A peer that issues its first all-gather late (after everything else) hangs its whole DP group.
    late = trace["ranks"][2]
    first = next(k for k, e in enumerate(late) if any(op["op"] == "coll" for op in e.get("issue", ())))
    late.append(late.pop(first))  # the indices of later issues shift: the check must still see the hang
    problems = check_trace(trace, sends_wait_for_receive=False)
    assert any("deadlock" in p or "mismatch" in p for p in problems), problems
    # Peers gathering chunks in another order: a mismatch.
    trace = record_zero_trace("interleaved", 2, 2, 4, replicas=2)
    colls = [op for e in trace["ranks"][3] for op in e.get("issue", ()) if op["op"] == "coll"]
    colls[0]["msg"], colls[1]["msg"] = colls[1]["msg"], colls[0]["msg"]
    assert any("mismatch" in p for p in check_trace(trace, sends_wait_for_receive=False))


def _config(args: list[str]):
    import argparse

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(args))


def test_bad_sharding_flags_are_each_one_line():
    d1 = validate(_config(["--data-parallel-sharding-strategy", "optim_grads_params"]), 1)
    assert len(d1) == 1 and "--data-parallel-sharding-strategy optim_grads_params" in d1[0] and "d > 1" in d1[0]
    k3 = validate(_config(["--data-parallel-sharding-strategy", "optim", "--num-distributed-optimizer-instances",
                           "3"]), 4)
    assert len(k3) == 1 and "--num-distributed-optimizer-instances 3" in k3[0] and "d = 4" in k3[0]
    assert not validate(_config(["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]), 4)
    both = validate(_config(["--data-parallel-sharding-strategy", "optim_grads", "--num-distributed-optimizer-"
                             "instances", "2"]), 1)
    assert len(both) == 2  # every problem at once


def test_cli_strategy_with_one_data_parallel_rank_exits_2_with_one_line(capsys):
    proc = refused_in_process(["train", *TINY, "--data-parallel-sharding-strategy", "optim_grads"], capsys)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--data-parallel-sharding-strategy" in lines[0] and "Traceback" not in proc.stderr
