"""Vocabulary parallelism with ZeRO-3 and with ``--overlap-grad-reduce``: the S/T/EF/EB passes
are uses of chunk 0 in ZeRO-3's plan (``ptdp.schedule.param_sync``), the combined lists are deadlock-free
under the NCCL model, and training matches one process."""

from __future__ import annotations

import pytest
from helpers import assert_equivalent, run_layouts

from ptdp.schedule.actions import Action
from ptdp.schedule.param_sync import PARAM_USES, REDUCE, RELEASE, WAIT, add_param_sync
from ptdp.schedule.registry import build_schedule
from ptdp.simulate.nccl.model import check_all_send_models, check_trace
from ptdp.simulate.nccl.zero import record_zero_trace

SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("v-half", 2))


@pytest.mark.parametrize("reshard", [False, True])
@pytest.mark.parametrize("barriers", [1, 2])
def test_vocab_passes_run_on_gathered_slices_and_chunk_0_is_reduced_after_eb(reshard, barriers):
    for name, v in SCHEDULES:
        for p in (2, 4):
            for forward_only in (False, True):
                for r in range(p):
                    actions = add_param_sync(build_schedule(name, p, v, 2 * p, r, forward_only, barriers), reshard)
                    gathered, reduced = set(), []
                    for a in actions:
                        if a.op == WAIT:
                            gathered.add(a.chunk)
                        elif a.op in PARAM_USES:
                            assert a.chunk in gathered, f"{name} p={p} rank {r}: {a} on sharded weights"
                            assert a.chunk not in reduced, f"{name} p={p} rank {r}: {a} after the reduce"
                        elif a.op == RELEASE:
                            gathered.discard(a.chunk)
                        elif a.op == REDUCE:
                            reduced.append(a.chunk)
                    assert not gathered
                    if forward_only:
                        assert reduced == []  # a forward-only T adds no gradient
                    else:
                        assert sorted(reduced) == list(range(v))
                        eb = next(i for i, a in enumerate(actions) if a.op == "EB")
                        assert actions[eb + 1] == Action(REDUCE, 0, 0)  # chunk 0 reduced right after EB


@pytest.mark.parametrize("reshard", [False, True])
@pytest.mark.parametrize("barriers", [1, 2])
def test_zero3_with_vocab_passes_is_deadlock_free_under_nccl(reshard, barriers):
    for name, v in SCHEDULES:
        for p in (2, 4):
            for m in (p, 2 * p):
                for forward_only in (False, True):
                    trace = record_zero_trace(name, p, v, m, reshard, replicas=2, forward_only=forward_only,
                                              vocab_barriers=barriers)
                    comms = {e.get("comm") for e in trace["ranks"][0] if "issue" in e}
                    assert {"dp", "vocab"} <= comms
                    for model, problems in check_all_send_models(trace).items():
                        assert not problems, f"{name} p={p} m={m} ({model}): {problems[:3]}"


def test_a_replica_gathering_chunk_0_for_its_vocab_pass_late_is_caught():
    """The check sees the data-parallel and the pipeline communicators together: one replica's rank that
    issues its first gather of chunk 0 (before EF) last of all cannot complete."""
    trace = record_zero_trace("1f1b", 2, 1, 4, replicas=2, vocab_barriers=1)
    late = trace["ranks"][2]
    first = next(k for k, e in enumerate(late) if e.get("comm") == "dp")
    late.append(late.pop(first))
    problems = check_trace(trace, sends_wait_for_receive=False)
    assert any("deadlock" in p or "mismatch" in p for p in problems), problems


VP = ["--enable-vocab-parallel"]
ZERO3 = ["--data-parallel-sharding-strategy", "optim_grads_params"]
P4 = ["--pipeline-model-parallel-size", "4"]
P2 = ["--pipeline-model-parallel-size", "2"]


EVAL = ["--eval-interval", "3", "--eval-iters", "1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One spawn: p=4 d=2 1f1b with one and two barriers, (t,p,d,v)=(2,2,2,2) interleaved, p=2 d=2 v-half
    with --reshard-after-forward (and a validation pass: the forward-only list), all ZeRO-3; p=2 d=2 with
    --overlap-grad-reduce, alone and with ZeRO-2 (whose transient gradient buffers the slices' late
    gradients must allocate: no autograd hook sees them)."""
    return run_layouts(tmp_path_factory.mktemp("vocab-zero"), {
        "1f1b-1": (8, [*P4, *VP, *ZERO3]),
        "1f1b-2": (8, [*P4, *VP, *ZERO3, "--disable-fb-fusion"]),
        "interleaved-222": (8, ["--tensor-model-parallel-size", "2", *P2, "--virtual-pipeline-model-parallel-size",
                                "2", "--pipeline-schedule", "interleaved", *VP, *ZERO3]),
        "v-half-reshard": (4, [*P2, "--pipeline-schedule", "v-half", *VP, *ZERO3, "--reshard-after-forward",
                               *EVAL]),
        "overlap": (4, [*P2, *VP, "--overlap-grad-reduce", *EVAL]),
        "overlap-zero2": (4, [*P2, *VP, "--overlap-grad-reduce", "--data-parallel-sharding-strategy",
                              "optim_grads"]),
    })


@pytest.mark.parametrize("name", ["1f1b-1", "1f1b-2", "interleaved-222", "v-half-reshard", "overlap",
                                  "overlap-zero2"])
def test_matches_one_process(runs, reference, name):
    assert_equivalent(runs[name], reference)


def test_zero3_validation_loss_matches_without_sharding(runs):
    got, want = ([r["val_loss"] for r in runs[name].records if "val_loss" in r]
                 for name in ("v-half-reshard", "overlap"))
    assert want and got == pytest.approx(want, rel=1e-5)
