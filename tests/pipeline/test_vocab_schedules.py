"""Vocabulary parallelism's schedule side, without processes: every schedule with the S/T passes
and their collectives (one and two barriers) is NCCL-safe under the multi-communicator model, the model
catches collectives posted in a bad order, the passes sit where they must, and bad flags are one line."""

from __future__ import annotations

import pytest
from helpers import refused_in_process

from ptdp.schedule.registry import REGISTRY, build_schedule
from ptdp.schedule.vocab import end_ranks
from ptdp.simulate.nccl.model import check_all_send_models, record_comm_trace

ONE = ["--num-layers", "4", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
       "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "1"]


@pytest.mark.parametrize("name", list(REGISTRY))
@pytest.mark.parametrize("barriers", [1, 2])
def test_every_schedule_with_vocab_passes_is_nccl_safe(name, barriers):
    spec = REGISTRY[name]
    for p in (2, 4):
        v = spec.chunks or 2
        for m in (m for m in (p, 2 * p) if spec.takes_microbatches(p, m)):  # dualpipev: m >= 2p
            for per_direction in (False, True):
                for forward_only in (False, True):
                    trace = record_comm_trace(name, p, v, m, forward_only, per_direction=per_direction,
                                              vocab_barriers=barriers)
                    assert check_all_send_models(trace) == {k: [] for k in check_all_send_models(trace)}, \
                        (name, p, m, per_direction, forward_only)


def _lists(name: str, p: int, v: int, m: int, barriers: int) -> list[list]:
    return [build_schedule(name, p, v, m, r, vocab_barriers=barriers) for r in range(p)]


def test_collectives_in_another_order_on_one_rank_are_a_mismatch():
    lists = _lists("1f1b", 4, 1, 4, 2)
    c0 = [i for i, a in enumerate(lists[1]) if a.op == "C0"]
    lists[1][c0[0]], lists[1][c0[1]] = lists[1][c0[1]], lists[1][c0[0]]
    problems = check_all_send_models(record_comm_trace("1f1b", 4, 1, 4, lists=lists, vocab_barriers=2))
    assert all(any(line.startswith("mismatch:") and "collective" in line for line in found)
               for found in problems.values())


def test_waiting_for_a_barrier_before_feeding_the_pipeline_deadlocks():
    """Rank 0 runs microbatch 0's S and T (waiting on its broadcast and C0) before its F0: the last stage
    can never produce what the broadcast carries."""
    lists = _lists("1f1b", 4, 1, 4, 1)
    early = [a for a in lists[0] if a.microbatch == 0 and a.op in ("BCAST_H", "S", "C0", "T")]
    rest = [a for a in lists[0] if a not in early]
    lists[0] = rest[:2] + early + rest[2:]  # after EF and EMB
    problems = check_all_send_models(record_comm_trace("1f1b", 4, 1, 4, lists=lists, vocab_barriers=1))
    assert all(any(line.startswith("deadlock: rank 0") for line in found) for found in problems.values())


@pytest.mark.parametrize("name, v", [("1f1b", 1), ("interleaved", 2), ("v-half", 2), ("zbv", 2)])
@pytest.mark.parametrize("barriers", [1, 2])
def test_every_rank_runs_every_pass_once_and_the_last_backward_follows_its_barrier(name, v, barriers):
    p, m = 4, 8
    lists = _lists(name, p, v, m, barriers)
    _, last_rank, _ = end_ranks(p, v, REGISTRY[name].placement)
    for r, actions in enumerate(lists):
        ops = [a.op for a in actions]
        assert ops[:2] == ["EF", "EMB"] and ops[-2:] == ["EMB_G", "EB"]
        for op in ("S", "T", "BCAST_H", "C0"):
            assert sorted(a.microbatch for a in actions if a.op == op) == list(range(m)), (r, op)
        assert ops.count("C1") == (m if barriers == 2 else 0)
        for j in range(m):
            s, c0, t = (actions.index(next(a for a in actions if a.op == op and a.microbatch == j))
                        for op in ("S", "C0", "T"))
            assert s < c0 < t
    last = REGISTRY[name].placement == "v" and 1 or v - 1
    for j in range(m):
        order = [a.op for a in lists[last_rank] if a.microbatch == j and (a.op in ("T", "C1") or (
            a.op in ("B", "I") and a.chunk == last))]
        assert order.index("T") < order.index("B" if "B" in order else "I")


@pytest.mark.parametrize("flags, first_words", [
    (["--enable-vocab-parallel"], "ptdp train: error: --enable-vocab-parallel splits the vocabulary over "
                                  "pipeline ranks: it needs --pipeline-model-parallel-size > 1"),
    (["--disable-fb-fusion"], "ptdp train: error: --disable-fb-fusion needs --enable-vocab-parallel"),
])
def test_bad_vocab_parallel_flags_are_one_line_exit_2(flags, first_words, capsys):
    proc = refused_in_process(["train", *ONE, *flags], capsys)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr and len(lines) == 1 and lines[0].startswith(first_words), proc.stderr


def test_a_vocabulary_smaller_than_p_times_t_is_refused():
    from ptdp.cli.main import build_parser
    from ptdp.config import config_from_args, validate

    args = ["train", *ONE, "--pipeline-model-parallel-size", "4", "--tensor-model-parallel-size", "2",
            "--enable-vocab-parallel", "--vocab-size", "7"]
    errors = validate(config_from_args(build_parser().parse_args(args)), 8)
    assert errors == ["--enable-vocab-parallel: --vocab-size 7 is smaller than pipeline x tensor parallel size "
                      "4x2: every rank needs at least one vocabulary row"]
