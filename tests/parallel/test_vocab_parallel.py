"""Vocabulary parallelism across pipeline stages: equivalence with one process, the schedules'
NCCL safety with the S/T passes and their collectives, and the flags' errors."""

from __future__ import annotations

import pytest
from helpers import assert_equivalent, assert_same_run, run_layouts

VP = ["--enable-vocab-parallel"]
P4 = ["--pipeline-model-parallel-size", "4"]
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights"]


@pytest.fixture(scope="module")
def gpt_runs(tmp_path_factory):
    """GPT (tied), one spawn: p=4 1f1b with one and two barriers, (t,p,d)=(2,2,2) interleaved, p=4 v-half,
    and an uneven layout string (``ptdp.schedule.layout``) with vocabulary parallelism."""
    return run_layouts(tmp_path_factory.mktemp("vocab-gpt"), {
        "1f1b-1": (4, [*P4, *VP]),
        "1f1b-2": (4, [*P4, *VP, "--disable-fb-fusion"]),
        "interleaved-222": (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                "--virtual-pipeline-model-parallel-size", "2", "--pipeline-schedule",
                                "interleaved", *VP]),
        "v-half": (4, [*P4, "--pipeline-schedule", "v-half", *VP, "--num-layers", "8"]),
        "layout-1": (4, [*P4, *VP, "--pipeline-model-parallel-layout", "Et|t|tt|L"]),  # uneven, no layer last
    })


@pytest.mark.parametrize("name", ["1f1b-1", "1f1b-2", "interleaved-222", "layout-1"])
def test_gpt_tied_matches_one_process(gpt_runs, reference, name):
    assert_equivalent(gpt_runs[name], reference)


def test_gpt_v_half_matches_one_process(gpt_runs, reference_8_layers):
    assert_equivalent(gpt_runs["v-half"], reference_8_layers)


T2P2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
SIX = ["--train-iters", "6"]
EVAL = ["--eval-interval", "3", "--eval-iters", "1"]


@pytest.fixture(scope="module")
def more_runs(tmp_path_factory):
    """One spawn: Llama and untied GPT with their one-process references; sequence parallelism with full
    recomputation and the distributed optimizer, or selective recomputation and ZeRO-2; a checkpoint saved vocabulary-parallel at p=4 resumed at
    p=2 without it."""
    tmp = tmp_path_factory.mktemp("vocab-more")
    ckpt = tmp / "vp-p4"
    return run_layouts(tmp, {
        "llama-ref": (1, LLAMA),
        "llama-1f1b-1": (4, [*LLAMA, *P4, *VP]),
        "llama-t2p2d2-sp-2": (8, [*LLAMA, *T2P2, *VP, "--disable-fb-fusion", "--sequence-parallel",
                                  "--use-distributed-optimizer", "--recompute-granularity", "full"]),
        "untied-ref": (1, ["--untie-embeddings-and-output-weights", *EVAL]),
        "untied-1f1b-2": (4, [*P4, *VP, "--disable-fb-fusion", "--untie-embeddings-and-output-weights", *EVAL]),
        "gpt-t2p2d2-sp-1": (8, [*T2P2, *VP, "--sequence-parallel", "--recompute-granularity", "selective",
                                "--data-parallel-sharding-strategy", "optim_grads"]),  # ZeRO-2 too
        "ref6": (1, SIX),
        "save-vp-p4": (4, [*SIX, *P4, *VP, "--save", str(ckpt), "--exit-interval", "3"]),
        "resume-p2": (2, [*SIX, "--pipeline-model-parallel-size", "2", "--load", str(ckpt)]),
    })


@pytest.mark.parametrize("name, ref", [("llama-1f1b-1", "llama-ref"), ("llama-t2p2d2-sp-2", "llama-ref"),
                                       ("untied-1f1b-2", "untied-ref")])
def test_llama_and_untied_match_one_process(more_runs, name, ref):
    assert_equivalent(more_runs[name], more_runs[ref])


def test_validation_loss_runs_the_forward_only_vocab_passes(more_runs):
    got, want = ([r["val_loss"] for r in more_runs[name].records if "val_loss" in r]
                 for name in ("untied-1f1b-2", "untied-ref"))
    assert want and got == pytest.approx(want, rel=1e-5)


def test_sequence_parallel_recompute_matches_one_process(more_runs, reference):
    assert_equivalent(more_runs["gpt-t2p2d2-sp-1"], reference)


def test_checkpoint_saved_vocab_parallel_resumes_at_p2_without_it(more_runs):
    """The slices save as the global embedding: p=2 without vocabulary parallelism continues identically."""
    resumed = more_runs["resume-p2"]
    assert [r["iteration"] for r in resumed.records] == [4, 5, 6]
    assert_equivalent(resumed, more_runs["ref6"])
    assert_same_run(more_runs["save-vp-p4"], more_runs["ref6"])  # its weights are iteration 3's
