"""Context parallelism (``--context-parallel-size``) trains the same model as one process.

Every layout below splits each sample's sequence over c ranks (two load-balanced chunks each) and must
reproduce the single-process losses and gradient norms, and weights, to fp32 tolerance: alone, with TP + sequence parallelism, with a
pipeline, with data parallelism and the distributed optimizer, with both comm types, and for a long
sequence with rotary positions. A checkpoint saved with c=2 resumes with c=1 and c=4. Bad input is one
line naming the flag. All the training runs share one spawn of 4 processes (``helpers.run_layouts``).
"""

from __future__ import annotations

import argparse

import pytest
from helpers import (
    TINY,
    assert_equivalent,
    assert_same_run,
    refused_in_process,
    run_layouts,
    validated_config,
)

from ptdp.config import add_config_arguments, config_from_args, validate

RTOL = 1e-4  # fp32: the attention and the gradient reductions sum in another order
FOUR = [*TINY, "--train-iters", "4"]  # the later --train-iters wins


def cp(c: int, comm: str = "p2p") -> list[str]:
    return ["--context-parallel-size", str(c), "--cp-comm-type", comm]


LAYOUTS = {
    "c2-p2p": (2, cp(2, "p2p")),
    "c4-a2a": (4, cp(4, "a2a")),
    "t2c2-sp": (4, [*cp(2, "p2p"), "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "c2p2-1f1b": (4, [*cp(2, "p2p"), "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b"]),
    "c2d2-distopt-a2a": (4, [*cp(2, "a2a"), "--use-distributed-optimizer"]),  # d = 2: gradients over dp-cp
}
# s=1024 over c=2 with RoPE and grouped-query attention: rotary follows the real positions.
LONG = [*TINY, "--num-layers", "2", "--seq-length", "1024", "--global-batch-size", "4", "--train-iters", "2",
        "--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups", "2"]


def plan(tmp) -> dict:
    ckpt = str(tmp / "c2-ckpt")
    return {
        **{name: (n, [*TINY, *flags]) for name, (n, flags) in LAYOUTS.items()},
        "long-one-process": (1, LONG),
        "long-c2": (2, [*LONG, *cp(2)]),
        # Parameters are replicated over CP, so the checkpoint is the same whatever c saved it.
        "four-one-process": (1, FOUR),
        "four-c2-save": (2, [*FOUR, *cp(2), "--save", ckpt, "--exit-interval", "2"]),
        "four-resume-c1": (1, [*FOUR, "--load", ckpt]),
        "four-resume-c4-distopt": (4, [*FOUR, *cp(4), "--use-distributed-optimizer", "--load", ckpt]),  # Adam over dp-cp
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp")
    return run_layouts(tmp, plan(tmp), base=[])


@pytest.mark.parametrize("name", LAYOUTS)
def test_context_parallel_matches_single_process(runs, reference, name):
    assert_equivalent(runs[name], reference, RTOL)


def test_long_sequence_with_rotary_positions(runs):
    assert_equivalent(runs["long-c2"], runs["long-one-process"], RTOL)


def test_checkpoint_saved_with_c2_resumes_with_c1_and_c4(runs):
    straight = runs["four-one-process"]
    first = runs["four-c2-save"]
    assert [r["iteration"] for r in first.records] == [1, 2]
    assert_same_run(first, straight, RTOL)
    for name in ("four-resume-c1", "four-resume-c4-distopt"):
        resumed = runs[name]
        assert [r["iteration"] for r in resumed.records] == [3, 4]
        assert_equivalent(resumed, straight, RTOL)


@pytest.mark.parametrize("world,flags,message", [
    (6, ["--context-parallel-size", "3", "--seq-length", "16"],
     "--context-parallel-size 3 needs --seq-length divisible by 2c = 6"),
    (4, ["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--tensor-model-parallel-size", "2",
         "--num-attention-heads", "2"], "--cp-comm-type a2a needs the local heads"),
    (2, ["--context-parallel-size", "2", "--attention-dropout", "0.1"], "needs --attention-dropout 0"),
    (3, ["--context-parallel-size", "2"], "x --context-parallel-size x"),
    (8, ["--context-parallel-size", "2", "--tensor-model-parallel-size", "4", "--sequence-parallel",
         "--seq-length", "12"], "--sequence-parallel with --context-parallel-size 2 needs"),
])
def test_bad_context_parallel_input_names_the_flag(world, flags, message):
    assert validated_config([*TINY, *cp(1)])  # c = 1 stays valid
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    errors = validate(config_from_args(parser.parse_args([*TINY, *flags])), world)
    assert len(errors) == 1 and message in errors[0], errors


def test_bad_input_is_one_line_before_any_process_group(capsys):
    proc = refused_in_process(["train", *TINY, *cp(2, "a2a"), "--num-attention-heads", "2", "--hidden-size",
                               "32", "--tensor-model-parallel-size", "2", "--nproc-per-node", "4"], capsys)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--cp-comm-type a2a" in errors[0], proc.stderr[-2000:]


def test_planner_models_context_parallel_memory_and_traffic():
    """Per-rank activations are 1/c of c = 1's; the ring's traffic is 3(c-1) hops of this rank's K and V."""
    from dataclasses import replace

    from ptdp.planner.memory import activation_bytes_per_layer
    from ptdp.planner.perf import cp_bytes_per_layer
    from ptdp.planner.spec import MODEL_PRESETS, ParallelConfig

    model = replace(MODEL_PRESETS["llama2-7b"], seq_length=32768)
    one = ParallelConfig(2, 1, 4, micro_batch_size=1)
    for c in (2, 4, 8):
        cfg = replace(one, data_parallel_size=4 // c if c <= 4 else 1, context_parallel_size=c)
        assert activation_bytes_per_layer(model, cfg) == pytest.approx(activation_bytes_per_layer(model, one) / c)
        assert cp_bytes_per_layer(model, cfg) == 3 * (c - 1) * 2 * (32768 / c) * (4096 / 2) * 2
    assert cp_bytes_per_layer(model, one) == 0


def test_plan_searches_context_parallelism_for_long_sequences():
    from dataclasses import replace

    from ptdp.planner.search import search
    from ptdp.planner.spec import MODEL_PRESETS, ClusterSpec, TrainingSpec

    cluster, train = ClusterSpec.of("h100-80gb", 64), TrainingSpec(64)
    long = search(replace(MODEL_PRESETS["llama2-7b"], seq_length=32768), cluster, train)
    assert long.best is not None and long.best.config.context_parallel_size > 1
    short = search(MODEL_PRESETS["llama2-7b"], cluster, train, top=20)
    assert {e.config.context_parallel_size for e in [short.best, *short.runners_up]} == {1}
