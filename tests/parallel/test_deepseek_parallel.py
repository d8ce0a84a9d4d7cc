"""DeepSeek-V3-style models under every parallelism: ``ptdp train --model tiny-deepseek``
(MLA, the sigmoid router with its expert bias and groups, a shared expert, a first dense layer, one MTP
module) equal to one process in the LM loss, the MTP loss, the gradient norm, the final weights and the
expert biases, in one spawn of every layout of interest -- (t, e) = (2, 2) folded with sequence
parallelism, p = 4 interleaved with MTP on the last stage, p = 4 with vocabulary parallelism carrying the MTP
heads, c = 2 with MLA, ZeRO-3 with zbv -- and a resume that restores the biases; plus the NCCL model on
every schedule's vocabulary passes with the MTP heads' embedding on the last stage."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_equivalent, run_layouts

from ptdp.schedule.registry import REGISTRY
from ptdp.simulate.nccl.model import check_all_send_models, record_comm_trace

# eight layers (one dense, seven MoE): p = 4 interleaved needs p·v = 8 stages
BASE = ["--model", "tiny-deepseek", "--num-layers", "8", "--moe-layer-freq", "([0]*1+[1]*7)",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-3",
        "--lr-warmup-iters", "1", "--log-interval", "1", "--moe-aux-loss-coeff", "1e-2"]

LAYOUTS = {
    "t2-e2-sp": (2, ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                     "--expert-tensor-parallel-size", "1", "--sequence-parallel"]),  # e folded over the TP ranks
    "p4-interleaved": (4, ["--pipeline-model-parallel-size", "4", "--virtual-pipeline-model-parallel-size", "2",
                           "--pipeline-schedule", "interleaved"]),  # MTP with the last stage, on rank 3
    "p4-vocab": (4, ["--pipeline-model-parallel-size", "4", "--enable-vocab-parallel"]),  # MTP heads in S/T
    "p2-t2-vocab2-sp": (4, ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                            "--sequence-parallel", "--enable-vocab-parallel", "--disable-fb-fusion"]),
    "c2": (2, ["--context-parallel-size", "2", "--recompute-granularity", "selective"]),  # ring attention
    "c2-allgather": (2, ["--context-parallel-size", "2", "--cp-comm-type", "allgather"]),
    "zbv-zero3": (4, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
                      "--data-parallel-sharding-strategy", "optim_grads_params"]),  # d = 2
    "p2-layout-full": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Ettt|t*5mL",
                           "--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "1"]),
}


RESUME = ["--pipeline-model-parallel-size", "2", "--data-parallel-sharding-strategy", "optim"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deepseek-parallel")
    ckpt = tmp / "resume"
    plan = {"one": (1, []), **LAYOUTS,
            # p = 2, d = 2, ZeRO-1: the last stage's copy of the embedding (MTP) is saved once and loaded back
            "stopped": (4, [*RESUME, "--exit-interval", "2", "--save", str(ckpt)]),
            "resumed": (4, [*RESUME, "--load", str(ckpt), "--save", str(ckpt)])}
    return run_layouts(tmp, plan, base=BASE)


def _biases(run) -> dict[str, torch.Tensor]:
    return {k: v for k, v in run.weights.items() if k.endswith("expert_bias")}


def _assert_like_one_process(run, ref) -> None:
    assert_equivalent(run, ref)
    want = {r["iteration"]: r["mtp_loss"] for r in ref.records}
    for record in run.records:
        assert abs(record["mtp_loss"] - want[record["iteration"]]) <= 1e-5 * want[record["iteration"]], record
    biases = _biases(ref)
    assert len(biases) == 8 and any(b.abs().sum() > 0 for b in biases.values())  # 7 MoE layers + MTP's; moved
    got = _biases(run)
    assert got.keys() == biases.keys()
    for name, bias in got.items():  # the sign steps of one process: exactly
        assert torch.equal(bias, biases[name]), name


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_one_process(runs, layout):
    _assert_like_one_process(runs[layout], runs["one"])


def test_resume_restores_the_expert_bias(runs):
    """Stopped after iteration 2 and resumed, iteration 3 is the uninterrupted run's: the checkpoint holds
    the expert biases, which decide iteration 3's routing."""
    assert [r["iteration"] for r in runs["resumed"].records] == [3]
    _assert_like_one_process(runs["resumed"], runs["one"])


def test_the_mtp_loss_is_reported_and_differs_from_the_lm_loss(runs):
    """A control: the MTP loss is its own number (a head wired to the main labels would equal the LM loss)."""
    for record in runs["one"].records:
        assert record["mtp_loss"] > 0 and abs(record["mtp_loss"] - record["loss"]) > 1e-3


@pytest.mark.parametrize("name", list(REGISTRY))
def test_vocab_passes_with_mtp_embedding_on_the_last_stage_are_nccl_safe(name):
    """With MTP the last stage's forwards also wait for EMB (an all-reduce then): every schedule stays
    deadlock-free under every send model, one and two barriers, training and evaluation."""
    v = REGISTRY[name].chunks or 2
    for barriers in (1, 2):
        for p in (2, 4):
            for forward_only in (False, True):
                trace = record_comm_trace(name, p, v, 2 * p, forward_only, per_direction=True,
                                          vocab_barriers=barriers, vocab_embeds_last=True)
                for model, problems in check_all_send_models(trace).items():
                    assert not problems, (name, barriers, p, forward_only, model, problems[:2])
