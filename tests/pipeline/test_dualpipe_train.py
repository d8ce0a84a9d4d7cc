"""DualPipeV and combined 1F1B train the same model as one process: loss and gradient norm per
iteration, final weights.

The overlapped pairs run as interleaved pieces (``ptdp.parallel.pipeline.overlap``, ``ptdp.models.pieces``):
one microbatch's forward and another's backward alternate piece by piece, the expert dispatch and combine
of each issued asynchronously over gloo and waited on only by the piece that needs them. A MoE model whose
chunks hold dense and MoE layers (``--moe-layer-freq 2``), under dualpipev at p = 2 and 4 with e = 2 and 4
and both dispatchers, with full and selective recomputation, ZeRO-3, vocabulary parallelism, and (t, c) = (2,
2) with sequence parallelism; ``--overlap-moe-expert-parallel-comm`` (with ``--delay-wgrad-compute``) under
1f1b and interleaved; checkpoints saved by dualpipev resume in 1f1b and interleaved, and a 1f1b checkpoint in
dualpipev, at the uninterrupted run's iterations 3 and 4. One spawn for all (``helpers.run_layouts``).
Two iterations where nothing resumes: the second's loss is the first update's, its gradient norm the
second's (the last iteration's learning rate is the schedule's minimum, 0, so a third would add only one
more forward and backward); the resumed runs train four, the first at the full rate with Adam's moments
from the checkpoint.
"""

from __future__ import annotations

import pytest
from helpers import TINY, assert_equivalent, assert_same_run, run_layouts

# micro-batch 1: m = B/d microbatches, at least the 2p dualpipev needs; B = 8 where that is enough (m = 4 at
# p = 2, d = 2), B = 16 (against a reference of its own) at p = 4, d = 2 and at p = 2, d = 4
MOE = [*TINY, "--num-layers", "8", "--micro-batch-size", "1", "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-aux-loss-coeff", "0.01", "--moe-layer-freq", "2", "--moe-token-dispatcher-type", "alltoall",
       "--train-iters", "2"]
B16 = ["--global-batch-size", "16"]
FOUR = ["--train-iters", "4"]
E2, E4 = ["--expert-model-parallel-size", "2"], ["--expert-model-parallel-size", "4"]
ALLGATHER = ["--moe-token-dispatcher-type", "allgather"]


def pipeline(p: int, schedule: str) -> list[str]:
    return ["--pipeline-model-parallel-size", str(p), "--pipeline-schedule", schedule]


DUALPIPEV = pipeline(2, "dualpipev")
INTERLEAVED = [*pipeline(2, "interleaved"), "--virtual-pipeline-model-parallel-size", "2"]
OVERLAP = ["--overlap-moe-expert-parallel-comm"]

LAYOUTS = {
    "p2e2-recompute": (4, [*DUALPIPEV, *E2, "--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "1"]),
    "p2e2-allgather-selective": (4, [*DUALPIPEV, *E2, *ALLGATHER, "--recompute-granularity", "selective"]),
    "p4e2": (8, [*B16, *pipeline(4, "dualpipev"), *E2]),
    "p2e4-allgather": (8, [*B16, *DUALPIPEV, *E4, *ALLGATHER]),
    "p2e2-zero3": (4, [*DUALPIPEV, *E2, "--data-parallel-sharding-strategy", "optim_grads_params"]),
    "p2-vocab": (2, [*DUALPIPEV, "--enable-vocab-parallel"]),
    "p2t2c2-sp": (8, [*DUALPIPEV, "--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
                      "--sequence-parallel", "--expert-tensor-parallel-size", "1", *E2]),
    "1f1b-overlap-delay": (4, [*pipeline(2, "1f1b"), *E2, *OVERLAP, "--delay-wgrad-compute"]),
    "interleaved-overlap-allgather": (4, [*INTERLEAVED, *E2, *OVERLAP, *ALLGATHER]),
}
# saver: (world, layout), [(loader, world, layout)]
RESHARDS = {
    "dualpipev": ((4, [*DUALPIPEV, *E2]), [("1f1b", 2, pipeline(2, "1f1b")), ("interleaved", 4, [*INTERLEAVED, *E2])]),
    "1f1b": ((2, pipeline(2, "1f1b")), [("dualpipev", 4, [*DUALPIPEV, *E2, *ALLGATHER])]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dualpipe")
    plan = {"one": (1, []), "one-b16": (1, B16), "one-four": (1, FOUR), **LAYOUTS}
    for saver, ((n, flags), loaders) in RESHARDS.items():
        ckpt = str(tmp / f"{saver}-save")
        plan[f"{saver}-save"] = (n, [*FOUR, *flags, "--save", ckpt, "--exit-interval", "2"])
        for loader, world, layout in loaders:
            plan[f"{saver}-to-{loader}"] = (world, [*FOUR, *layout, "--load", ckpt])
    return run_layouts(tmp, plan, base=MOE)


@pytest.mark.parametrize("name", LAYOUTS)
def test_overlapped_pairs_train_as_one_process(runs, name):
    assert_equivalent(runs[name], runs["one-b16" if B16[0] in LAYOUTS[name][1] else "one"])


@pytest.mark.parametrize("saver", RESHARDS)
def test_checkpoints_reshard_to_and_from_dualpipev(runs, saver):
    reference = runs["one-four"]
    first = runs[f"{saver}-save"]
    assert [r["iteration"] for r in first.records] == [1, 2]
    assert_same_run(first, reference)
    for loader, _, _ in RESHARDS[saver][1]:
        resumed = runs[f"{saver}-to-{loader}"]
        assert [r["iteration"] for r in resumed.records] == [3, 4]
        assert_equivalent(resumed, reference)


def test_dualpipev_reports_its_bubble_formula(runs):
    """(p-1)/(3m) = 1/12 of the ideal time with m = 4 at p = 2 (d = 2), the closed form of (PP/2-1)(F&B+B-3W);
    the record gives it as a share of the whole iteration, 1/13."""
    assert runs["p2e2-recompute"].records[-1]["bubble_fraction_formula"] == pytest.approx(1 / 13)
