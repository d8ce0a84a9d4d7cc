"""``ptdp plan`` with a mixture of experts: it searches the expert-parallel size e (and etp, and
the dispatcher), divides the experts' states by e·etp (sharded over the expert-data-parallel group), and
prices the token dispatch. The estimate against measured model states is in tests/parallel/test_moe_parallel.py."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from ptdp.models.flops import MoEShape
from ptdp.planner import ClusterSpec, GPTSpec, ParallelConfig, TrainingSpec, add_plan_arguments, run_plan
from ptdp.planner.experts import expert_data_parallel_size, layer_parameters
from ptdp.planner.memory import memory_per_gpu
from ptdp.planner.perf import stage_times
from ptdp.planner.search import candidates, invalid_reason, search
from ptdp.planner.spec import MODEL_PRESETS

MIXTRAL = dataclasses.replace(MODEL_PRESETS["mixtral-8x7b"], seq_length=4096)
H100_64 = ClusterSpec.of("h100-80gb", 64)
TRAIN = TrainingSpec(256, "bf16")


def test_mixtral_needs_expert_parallelism_when_replicated_experts_do_not_fit():
    """Pure data parallelism on 64 H100s (t = p = 1): with every expert on every rank (e = 1) no layout fits,
    whatever the ZeRO stage or recomputation; the search proposes e > 1, and its model states are what
    e divides."""
    pinned = dict(tensor_sizes=[1], pipeline_sizes=[1])
    replicated = search(MIXTRAL, H100_64, TRAIN, configs=candidates(MIXTRAL, H100_64, TRAIN, expert_sizes=[1],
                                                                        **pinned))
    assert replicated.best is None and replicated.num_evaluated > 0
    found = search(MIXTRAL, H100_64, TRAIN, configs=candidates(MIXTRAL, H100_64, TRAIN, **pinned))
    assert found.best is not None and found.best.fits
    e = found.best.config.expert_model_parallel_size
    assert e > 1
    same_but_e1 = dataclasses.replace(found.best.config, expert_model_parallel_size=1)
    assert memory_per_gpu(MIXTRAL, same_but_e1, 256, "bf16").model_states > 2 * found.best.memory.model_states


def _plan(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return run_plan(parser.parse_args(list(argv)))


def test_plan_output_names_e(capsys):
    args = ["--model", "mixtral-8x7b", "--gpus", "64", "--gpu", "h100-80gb", "--bf16", "--seq-length", "4096",
            "--global-batch-size", "256", "--tensor-model-parallel-size", "1", "--top", "2", "--micro-batch-size", "1",
            "--recompute-granularity", "full"]
    assert _plan(*args) == 0
    out = capsys.readouterr().out
    assert any(line.split()[:5] == ["t", "c", "p", "d", "e"] for line in out.splitlines()), out
    assert "expert-data-parallel ranks" in out and "\n  - e = " in out
    assert _plan(*args, "--json") == 0
    best = json.loads(capsys.readouterr().out)
    assert best["fits"] and best["expert_model_parallel_size"] > 1 and "expert_data_parallel_size" in best
    # pinned: e = 2 is what is evaluated, in every runner-up too
    assert _plan(*args, "--json", "--expert-model-parallel-size", "2") == 0
    pinned = json.loads(capsys.readouterr().out)
    assert {r["expert_model_parallel_size"] for r in [pinned, *pinned["runners_up"]]} == {2}


def test_dense_plans_have_no_e_column(capsys):
    assert _plan("--model", "gpt3-175b", "--gpus", "1024", "--tensor-model-parallel-size", "8",
                 "--pipeline-model-parallel-size", "16") == 0
    out = capsys.readouterr().out
    assert any(line.split()[:5] == ["t", "c", "p", "d", "v"] for line in out.splitlines()), out


TINY = GPTSpec(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=384,
               moe=MoEShape(num_experts=4, topk=2, ffn=128, moe_layers=2, shared_ffn=24))


def test_experts_divide_by_e_times_etp_and_the_rest_does_not():
    dense1, experts1 = layer_parameters(TINY, t=1)
    for t, e, etp in ((1, 2, 1), (1, 4, 1), (2, 2, 1), (2, 2, 2), (2, 1, 2)):
        dense, experts = layer_parameters(TINY, t, e, etp)
        assert experts == pytest.approx(experts1 / (e * etp))
        assert dense <= dense1 and (t > 1 or dense == dense1)
    # edp: the stage's t·c·d ranks over etp·e
    assert expert_data_parallel_size(ParallelConfig(2, 1, 4, expert_model_parallel_size=4)) == 1
    assert expert_data_parallel_size(ParallelConfig(2, 1, 4, expert_model_parallel_size=4,
                                                    expert_tensor_parallel_size=1)) == 2


def test_dispatch_is_priced_and_allgather_moves_more_than_alltoall_at_e8():
    cluster = ClusterSpec.of("h100-80gb", 16)
    base = ParallelConfig(1, 1, 16, micro_batch_size=1)
    assert stage_times(MIXTRAL, base, cluster).ep_comm == 0.0  # e = 1: nothing moves
    a2a = stage_times(MIXTRAL, dataclasses.replace(base, expert_model_parallel_size=8,
                                                   moe_token_dispatcher_type="alltoall"), cluster).ep_comm
    ag = stage_times(MIXTRAL, dataclasses.replace(base, expert_model_parallel_size=8,
                                                  moe_token_dispatcher_type="allgather"), cluster).ep_comm
    assert 0 < a2a < ag
    # e = 16 spans two servers: the network is slower than NVLink
    wide = ParallelConfig(1, 1, 16, micro_batch_size=1, expert_model_parallel_size=8, moe_token_dispatcher_type="alltoall")
    assert stage_times(dataclasses.replace(MIXTRAL, moe=dataclasses.replace(MIXTRAL.moe, num_experts=16)),
                       dataclasses.replace(wide, expert_model_parallel_size=16), cluster).ep_comm > a2a


@pytest.mark.parametrize("changes, expected", [
    (dict(expert_model_parallel_size=3), "--expert-model-parallel-size 3 does not divide --num-experts 8"),
    (dict(tensor_model_parallel_size=4, data_parallel_size=4, expert_tensor_parallel_size=2), "cannot fold"),
    (dict(moe_token_dispatcher_type="broadcast"), "--moe-token-dispatcher-type"),
])
def test_bad_expert_layouts_are_refused_with_the_flag(changes, expected):
    cfg = dataclasses.replace(ParallelConfig(1, 1, 16), **changes)
    reason = invalid_reason(MIXTRAL, cfg, ClusterSpec.of("h100-80gb", 16), TRAIN)
    assert reason is not None and expected in reason, reason
    dense = dataclasses.replace(MIXTRAL, moe=None)
    assert "needs a mixture-of-experts model" in invalid_reason(
        dense, ParallelConfig(1, 1, 16, expert_model_parallel_size=2), ClusterSpec.of("h100-80gb", 16), TRAIN)


# --- ptdp train's MoE flags (plan takes its model from train's dataclasses) -------------------------

GPT3_EXPERTS = ["--model", "gpt3-175b", "--gpus", "1024", "--tensor-model-parallel-size", "8",
                "--pipeline-model-parallel-size", "16", "--expert-model-parallel-size", "8"]


def test_train_moe_flags_turn_a_dense_preset_into_a_mixture_of_experts(capsys):
    """``--num-experts 8 --moe-router-topk 2`` on GPT-3's shape: the plan prices 8 experts of 4h (train's
    default expert size, --ffn-hidden-size), names e and counts the active parameters."""
    from ptdp.cli.main import main

    assert main(["plan", *GPT3_EXPERTS, "--num-experts", "8", "--moe-router-topk", "2"]) == 0
    out = capsys.readouterr().out
    moe = dataclasses.replace(MODEL_PRESETS["gpt3-175b"], moe=MoEShape(8, 2, 4 * 12288, 96))
    total, active = moe.parameter_count(), moe.parameter_count(active=True)
    assert f"model: {total / 1e9:.1f}B parameters ({active / 1e9:.1f}B active, E=8 k=2)" in out, out
    assert active < total / 3
    assert any(line.split()[:5] == ["t", "c", "p", "d", "e"] for line in out.splitlines()), out
    # --moe-layer-freq and a shared expert change the counts as they change train's model
    assert main(["plan", *GPT3_EXPERTS, "--num-experts", "8", "--moe-layer-freq", "2", "--json"]) == 0
    every_other = json.loads(capsys.readouterr().out)
    assert main(["plan", *GPT3_EXPERTS, "--num-experts", "8", "--json"]) == 0
    every = json.loads(capsys.readouterr().out)
    assert every_other["model_state_bytes"] < every["model_state_bytes"]
    assert main(["plan", *GPT3_EXPERTS, "--num-experts", "8", "--json",
                 "--moe-shared-expert-intermediate-size", "4096"]) == 0
    assert json.loads(capsys.readouterr().out)["flops_per_iteration"] > every["flops_per_iteration"]


def test_flags_override_a_moe_preset_and_spell_it_from_a_dense_one(capsys):
    """Mixtral's preset is Llama 3 8B's attention with 8 experts of 14336 at s = 32768, V = 32000: the same
    plan from train's flags; and a flag given over the preset wins (16 experts, top-4)."""
    from ptdp.cli.main import main

    layout = ["--gpus", "64", "--gpu", "h100-80gb", "--bf16", "--global-batch-size", "256",
              "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
              "--expert-model-parallel-size", "8", "--micro-batch-size", "1", "--recompute-granularity", "full",
              "--use-distributed-optimizer", "--json"]
    assert main(["plan", "--model", "mixtral-8x7b", *layout]) == 0
    preset = json.loads(capsys.readouterr().out)
    assert main(["plan", "--model", "llama3-8b", "--seq-length", "32768", "--vocab-size", "32000",
                 "--num-experts", "8", "--moe-router-topk", "2", *layout]) == 0
    assert json.loads(capsys.readouterr().out) == preset
    assert main(["plan", "--model", "mixtral-8x7b", *layout[:-1], "--num-experts", "16",
                 "--moe-router-topk", "4"]) == 0
    assert "E=16 k=4)" in capsys.readouterr().out


@pytest.mark.parametrize("flags, first_words", [
    (["--num-experts", "8", "--moe-router-topk", "9"], "--moe-router-topk 9 must be between 1 and --num-experts 8"),
    (["--num-experts", "0"], "--num-experts must be a positive integer, got 0"),
    (["--num-experts", "8", "--moe-layer-freq", "[1,0]"], "--moe-layer-freq '[1,0]' must list one 0 or 1 per layer"),
    (["--num-experts", "8", "--moe-shared-expert-gate"], "--moe-shared-expert-gate needs a shared expert"),
    (["--model", "mixtral-8x7b", "--moe-router-topk", "9"], "--moe-router-topk 9 must be between 1 and"),  # E=8
    (["--num-experts", "6"], "--expert-model-parallel-size 8 does not divide --num-experts 6"),
])
def test_bad_moe_flags_are_one_line_and_exit_2(capsys, flags, first_words):
    """train's rules (ptdp.config.validate_moe), one line naming the flag, exit 2, as in test_cli_messages."""
    from ptdp.cli.main import main

    assert main(["plan", *GPT3_EXPERTS, *flags]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith(f"ptdp plan: error: {first_words}"), err
