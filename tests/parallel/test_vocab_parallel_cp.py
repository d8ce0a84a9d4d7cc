"""Vocabulary parallelism with context parallelism: each of the c pipelines (one per CP rank)
splits the vocabulary over its p ranks for its own sequence slice, and the loss and the gradients average
over the CP ranks as without vocabulary parallelism. Equivalence with one process (losses, gradient norms,
final weights, the validation loss), and the NCCL model with the vocabulary barriers and the attention's
CP exchanges on every rank at once."""

from __future__ import annotations

import pytest
from helpers import assert_equivalent, run_layouts

from ptdp.schedule.registry import REGISTRY
from ptdp.simulate.nccl.context import record_context_vocab_trace
from ptdp.simulate.nccl.model import check_all_send_models, check_trace

P2C2 = ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2", "--enable-vocab-parallel"]
EVAL = ["--eval-interval", "3", "--eval-iters", "1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One spawn: the one-process reference (with a validation pass), p=2 c=2 1f1b with one barrier, with
    two barriers and the distributed optimizer, and (t, c, p) = (2, 2, 2) with sequence parallelism (the
    slices split over t too, each pipeline group at fixed t and c)."""
    return run_layouts(tmp_path_factory.mktemp("vocab-cp"), {
        "ref": (1, EVAL),
        "p2c2-1": (4, [*P2C2, *EVAL]),
        "p2c2-2": (4, [*P2C2, "--disable-fb-fusion", "--use-distributed-optimizer", *EVAL]),
        "t2c2p2-sp": (8, [*P2C2, "--tensor-model-parallel-size", "2", "--sequence-parallel", *EVAL]),
    })


@pytest.mark.parametrize("name", ["p2c2-1", "p2c2-2", "t2c2p2-sp"])
def test_context_parallel_vocab_parallel_matches_one_process(runs, name):
    assert_equivalent(runs[name], runs["ref"])
    got, want = ([r["val_loss"] for r in runs[k].records if "val_loss" in r] for k in (name, "ref"))
    assert want and got == pytest.approx(want, rel=1e-5)  # the forward-only passes on this CP rank's slice


@pytest.mark.parametrize("name", list(REGISTRY))
@pytest.mark.parametrize("barriers", [1, 2])
def test_every_schedule_with_cp_and_vocab_collectives_is_nccl_safe(name, barriers):
    v = REGISTRY[name].chunks or 2
    for p in (2, 4):
        for forward_only in (False, True):
            for per_direction in (False, True):
                trace = record_context_vocab_trace(name, p, v, 2 * p, 2, barriers, forward_only, per_direction)
                problems = check_all_send_models(trace)
                assert problems == {k: [] for k in problems}, (p, forward_only, per_direction)


def test_the_trace_holds_both_kinds_of_collective_on_their_own_groups():
    trace = record_context_vocab_trace("1f1b", 2, 1, 2, 2, 2)
    colls = [(e.get("comm"), op["msg"][0], tuple(op["group"])) for e in trace["ranks"][3] for op in e.get("issue", [])
             if op["op"] == "coll"]
    assert ("cp", "cp", (1, 3)) in colls and ("vocab", "C1", (2, 3)) in colls  # rank 3: CP rank 1, last stage
    assert all(op["peer"] == 2 for e in trace["ranks"][3] for op in e.get("issue", []) if op["op"] != "coll")


def test_cp_groups_across_stages_deadlock():
    """The attention exchange must pair the same stage of the c pipelines: pairing stage 0 of one with
    stage 1 of the other waits on a partner that is blocked on its own pipeline."""
    trace = record_context_vocab_trace("1f1b", 2, 1, 4, 2, 1, cp_groups=[[0, 3], [1, 2]])
    problems = check_trace(trace, sends_wait_for_receive=False)
    assert any(line.startswith("deadlock: rank 0 of 4") and "collective ['cp', 'F', 0, 0]" in line
               for line in problems), problems
