"""Expert parallelism end to end: every layout trains the tiny MoE model as one process does.

Per iteration the loss AND the gradient norm (a wrong expert-gradient averaging or a norm that counts an
expert twice changes the norm, not the losses), and the final weights, for: (e, d) = (2, 2); (t, e) = (2, 2)
with e folded over the tensor-parallel ranks, and with the experts' FFN split over them (etp = t); (p, e) = (2, 2) under 1F1B and ZBV (the zero-bubble W pass
over expert weights); e = 4 with the distributed optimizer; a shared expert; the all-gather dispatcher
against the all-to-all one; a checkpoint saved at e = 4 that continues identically at e = 1; and e = 4 folded over
t = 2 and c = 2 with sequence parallelism and full recomputation (each rank routes s/(t·c) tokens: the
load-balancing loss counts over the whole sequences, ``ptdp.parallel.expert.load_balancing``); the experts' FFN split
over t (etp = t) with sequence parallelism, at (t, e) = (2, 1), (t, c, e) = (2, 2, 2) with e folded over CP,
and (t, e, d) = (2, 2, 2) with full recomputation (tokens gathered over TP before the experts). Dropless
routing with the load-balancing loss on. All in one spawn of four processes (``helpers.run_layouts``).
``ptdp plan``'s model-state estimate is checked against these runs' measured ``model_state_bytes``.
"""

from __future__ import annotations

import pytest
from helpers import TINY, assert_equivalent, assert_same_run, run_layouts

# alltoall everywhere but "e4-allgather" (a later flag wins), so the two dispatchers are compared
MOE = [*TINY, "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff",
       "0.001", "--moe-token-dispatcher-type", "alltoall"]
SHARED = ["--moe-shared-expert-intermediate-size", "24"]
E2, E4 = ["--expert-model-parallel-size", "2"], ["--expert-model-parallel-size", "4"]
P2 = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
# e = 4 folded over t = 2 and c = 2 (MoE Parallel Folding: attention's TP and CP ranks hold the experts).
SP_CP = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2",
         "--expert-tensor-parallel-size", "1", *E4]
# etp = t with sequence parallelism: each TP rank routes its s/t tokens, the dispatcher gathers them over the
# expert-tensor (= TP) group and reduce-scatters the output; at c = 2, e = 2 folds over the CP ranks.
ETP_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe-parallel")
    stop = str(tmp / "e4-stop-ckpt")
    plan = {
        "one": (1, []),
        "one-shared": (1, SHARED),
        "e2d2": (4, E2),
        "t2e2": (2, ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", *E2]),
        "t2e2-etp2": (4, ["--tensor-model-parallel-size", "2", *E2]),  # etp = t (the default): FFN split
        "p2e2-1f1b-recompute": (4, [*P2, "1f1b", *E2, *RECOMPUTE]),
        "p2e2-zbv": (4, [*P2, "zbv", *E2]),
        "e4-dist-stop": (4, [*E4, "--use-distributed-optimizer", "--exit-interval", "2", "--save", stop]),
        "e4-allgather": (4, [*E4, "--moe-token-dispatcher-type", "allgather"]),
        "e2-shared": (4, [*E2, *SHARED]),
        "e1-resume": (1, ["--load", stop]),
        "t2c2e4-sp-recompute": (4, [*SP_CP, *RECOMPUTE]),
        "t2-etp2-sp": (2, ETP_SP),
        "t2c2e2-etp2-sp-allgather": (4, [*ETP_SP, "--context-parallel-size", "2", *E2, "--moe-token-dispatcher-type",
                                         "allgather"]),
        "t2e2d2-etp2-sp-recompute": (4, [*ETP_SP, *E2, *RECOMPUTE]),
    }
    return run_layouts(tmp, plan, base=MOE, save=set(plan) - {"e4-allgather"})  # its records alone are compared


@pytest.mark.parametrize("layout", ["e2d2", "t2e2", "t2e2-etp2", "p2e2-1f1b-recompute", "p2e2-zbv",
                                    "e4-allgather"])
def test_layout_matches_one_process(runs, layout):
    assert_equivalent(runs[layout], runs["one"])


def test_folded_over_tensor_and_context_with_sequence_parallel_and_recompute(runs):
    assert_equivalent(runs["t2c2e4-sp-recompute"], runs["one"])


@pytest.mark.parametrize("layout", ["t2-etp2-sp", "t2c2e2-etp2-sp-allgather", "t2e2d2-etp2-sp-recompute"])
def test_expert_tensor_parallel_with_sequence_parallel(runs, layout):
    assert_equivalent(runs[layout], runs["one"])


@pytest.mark.parametrize("layout", ["t2-etp2-sp", "t2c2e2-etp2-sp-allgather", "t2c2e4-sp-recompute"])
def test_moe_metrics_under_sequence_parallelism_are_the_one_process_ones(runs, layout):
    """Each TP rank routes its own s/t tokens: the reported losses, the busiest expert's load and the dropped
    tokens add up over the TP group (not 1/t of them)."""
    for got, want in zip(runs[layout].records, runs["one"].records, strict=True):
        for key in ("moe_aux_loss", "moe_z_loss", "moe_max_load_ratio"):
            assert got[key] == pytest.approx(want[key], rel=1e-4), (layout, key)
        assert got["moe_dropped_tokens"] == want["moe_dropped_tokens"] == 0


def test_shared_expert(runs):
    assert_equivalent(runs["e2-shared"], runs["one-shared"])
    assert runs["e2-shared"].losses != runs["one"].losses  # the shared expert is really there


def test_distributed_optimizer_and_checkpoint_from_e4_to_e1(runs):
    stopped, resumed = runs["e4-dist-stop"], runs["e1-resume"]
    assert [r["iteration"] for r in stopped.records] == [1, 2]
    assert_same_run(stopped, runs["one"])
    assert [r["iteration"] for r in resumed.records] == [3]
    assert_equivalent(resumed, runs["one"])


def test_dispatchers_agree(runs):
    assert_same_run(runs["e4-allgather"].records[:2], runs["e4-dist-stop"], rtol=1e-5)


@pytest.mark.parametrize("name, t, d, e, etp, strategy", [
    ("one", 1, 1, 1, None, "no_shard"), ("e2d2", 1, 4, 2, None, "no_shard"), ("t2e2", 2, 1, 2, 1, "no_shard"),
    ("t2e2-etp2", 2, 2, 2, None, "no_shard"), ("e4-dist-stop", 1, 4, 4, None, "optim")])
def test_plan_estimates_the_measured_model_states(runs, name, t, d, e, etp, strategy):
    """``ptdp plan``'s model states for a MoE layout (experts 1/(e·etp) per rank, their optimizer states
    sharded over the expert-data-parallel group) are the run's measured ``model_state_bytes`` within 5%
    (as tests/checkpointing/test_zero_checkpoint.py checks the dense ZeRO strategies)."""
    from ptdp.models.flops import MoEShape
    from ptdp.planner.memory import memory_per_gpu
    from ptdp.planner.spec import GPTSpec, ParallelConfig

    model = GPTSpec(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=384,  # padded
                    moe=MoEShape(num_experts=4, topk=2, ffn=128, moe_layers=4))
    cfg = ParallelConfig(t, 1, d, sharding_strategy=strategy, expert_model_parallel_size=e,
                         expert_tensor_parallel_size=etp)
    estimate = memory_per_gpu(model, cfg, 16, "fp32").model_states
    measured = runs[name].records[-1]["model_state_bytes"]
    assert abs(estimate - measured) <= 0.05 * measured, (estimate, measured)
    if e > 1:  # the experts really are divided: whole ones on every rank would be far off
        replicated = memory_per_gpu(model, ParallelConfig(t, 1, d, sharding_strategy=strategy,
                                                          expert_tensor_parallel_size=1), 16, "fp32")
        assert replicated.model_states > 1.3 * measured
