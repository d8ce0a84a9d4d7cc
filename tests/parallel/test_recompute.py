"""Activation recomputation: same numbers as no recomputation (dropout masks included), less memory kept."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from helpers import assert_equivalent, run_layouts
from test_nccl_model import microbatch_counts

from ptdp.config import Config, ModelConfig, validate
from ptdp.models import GPTModel
from ptdp.parallel import recompute
from ptdp.parallel.init import init_parameters
from ptdp.parallel.parallelize import parallelize
from ptdp.parallel.placement import Placements
from ptdp.parallel.recompute import recompute_environment_errors, recompute_plan
from ptdp.parallel.tensor import language_model_loss, model_parallel_seed
from ptdp.schedule.registry import SCHEDULES, schedule_placement
from ptdp.simulate.nccl.model import check_all_send_models
from ptdp.simulate.nccl.recompute import record_partitioned_trace

RTOL = 1e-4
DROPOUT_CFG = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                          hidden_dropout=0.2, attention_dropout=0.2)


def test_uniform_groups_layers_into_units():
    assert recompute_plan(4, "full", "uniform", 1) == [(range(i, i + 1), True) for i in range(4)]
    assert recompute_plan(5, "full", "uniform", 2) == [(range(0, 2), True), (range(2, 4), True),
                                                       (range(4, 5), True)]
    assert recompute_plan(4, "full", None, None) == recompute_plan(4, "full", "uniform", 1)


def test_block_recomputes_only_the_first_layers_of_a_chunk():
    assert [r for _, r in recompute_plan(4, "full", "block", 2)] == [True, True, False, False]
    assert [r for _, r in recompute_plan(4, "full", "block", 0)] == [False] * 4


@pytest.mark.parametrize("granularity", [None, "selective"])
def test_no_layer_units_without_full(granularity):
    assert recompute_plan(3, granularity, None, None) == [(range(3), False)]


def one_step_grads(**recompute_flags) -> dict[str, torch.Tensor]:
    """Seeded forward + backward of one batch with dropout on; the gradients by parameter name."""
    cfg = dataclasses.replace(DROPOUT_CFG, **recompute_flags)
    placements = Placements()
    model = parallelize(GPTModel(cfg, 50, 64), placements)  # t = 1: attention dropout on the tracker's stream
    init_parameters(model, seed=7, std=0.02, num_layers=cfg.num_layers, placements=placements)
    model_parallel_seed(1234, 0, 0, torch.device("cpu"))
    tokens = torch.randint(0, 50, (2, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # two microbatches: the second forward must see the RNG as advanced by the first
        language_model_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference_grads():
    return one_step_grads()


@pytest.mark.parametrize("flags", [
    {"recompute_granularity": "full"},
    {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
    {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 3},
    {"recompute_granularity": "selective"},
])
def test_dropout_masks_are_replayed_on_recompute(reference_grads, flags):
    got = one_step_grads(**flags)
    for name, grad in reference_grads.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_without_tracker_replay_masks_would_differ(monkeypatch, reference_grads):
    """The control: torch's checkpoint alone replays only the default generator, not the TP stream."""
    monkeypatch.setattr(recompute, "_replay_tracker_states",
                        lambda: (contextlib.nullcontext(), contextlib.nullcontext()))
    got = one_step_grads(recompute_granularity="selective")
    name = "layers.0.attention.qkv.weight"
    assert not torch.allclose(got[name], reference_grads[name], rtol=1e-3, atol=1e-6)


def _errors(world: int = 1, parallel: dict | None = None, **model_flags) -> list[str]:
    config = Config()
    config.model = dataclasses.replace(config.model, **model_flags)
    config.parallel = dataclasses.replace(config.parallel, **(parallel or {}))
    return validate(config, world)


@pytest.mark.parametrize("flags,message", [
    ({"recompute_method": "block"}, "--recompute-method applies only to --recompute-granularity full"),
    ({"recompute_granularity": "selective", "recompute_num_layers": 2},
     "--recompute-num-layers applies only to --recompute-granularity full"),
    ({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 5},
     "--recompute-num-layers 5 must be between 0 and the 4 layers"),
    ({"recompute_granularity": "full", "recompute_num_layers": 0}, "--recompute-num-layers must be >= 1"),
    ({"recompute_granularity": "selective", "distribute_saved_activations": True},
     "--distribute-saved-activations applies only to --recompute-granularity full"),
    ({"checkpoint_in_cpu": True}, "--checkpoint-in-cpu applies only to --recompute-granularity full"),
    ({"recompute_granularity": "full", "distribute_saved_activations": True},
     "--distribute-saved-activations needs --tensor-model-parallel-size > 1"),
])
def test_bad_recompute_flags_give_one_line(flags, message):
    errors = _errors(**flags)
    assert len(errors) == 1 and message in errors[0], errors


def test_distributed_saved_activations_refuse_sequence_parallelism():
    errors = _errors(2, {"tensor_model_parallel_size": 2, "sequence_parallel": True},
                     recompute_granularity="full", distribute_saved_activations=True)
    assert len(errors) == 1 and "cannot be used with --sequence-parallel" in errors[0], errors
    assert not _errors(2, {"tensor_model_parallel_size": 2}, recompute_granularity="full",
                       distribute_saved_activations=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU's")
def test_checkpoint_in_cpu_is_refused_on_the_cpu_in_one_line():
    config = Config()
    config.model = dataclasses.replace(config.model, recompute_granularity="full", checkpoint_in_cpu=True)
    assert not validate(config, 1)  # a valid configuration, which this machine cannot run
    errors = recompute_environment_errors(config)
    assert len(errors) == 1 and errors[0].startswith("--checkpoint-in-cpu needs a CUDA GPU"), errors


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_recompute_gathers_are_deadlock_free_under_nccl(name):
    """The all-gather each recomputed unit's backward makes over the tensor-parallel group, in every schedule
    (p = 2, 3; microbatch counts around the warm-up boundary; training and forward-only)."""
    for p in (2, 3):
        for v in (1, 2) if name == "interleaved" else (2,) if schedule_placement(name) == "v" else (1,):
            for m in microbatch_counts(name, p)[:4]:
                for forward_only in (False, True):
                    trace = record_partitioned_trace(name, p, v, m, t=2, units=2, forward_only=forward_only)
                    for model, found in check_all_send_models(trace).items():
                        assert not found, (name, p, v, m, forward_only, model, found[:2])
    trace = record_partitioned_trace(name, 2, 2 if name == "interleaved" or schedule_placement(name) == "v" else 1,
                                     4, t=2)
    gathers = [e for e in trace["ranks"][0] if e.get("comm") == "tp"]
    assert gathers and all(op["op"] == "coll" for e in gathers for op in e["issue"])


def test_a_tensor_parallel_group_across_stages_deadlocks():
    """The control: gathering with a rank of another stage (a group ParallelState never builds) hangs."""
    trace = record_partitioned_trace("1f1b", 2, 1, 4, t=2, tp_groups=[[0, 3], [1, 2]])
    assert all(any("deadlock" in line for line in found) for found in check_all_send_models(trace).values())


DROPOUT_ON = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
RECOMPUTE = {
    "full": ["--recompute-granularity", "full"],
    "full-block-2": ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"],
    "selective": ["--recompute-granularity", "selective"],
}
# Full recomputation at (2, 2, 2, 2) runs in tests/parallel/test_sequence_parallel.py (with sequence parallelism).
SELECTIVE_2222 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                  "--virtual-pipeline-model-parallel-size", "2", "--recompute-granularity", "selective"]
# ZeRO-R's partitioned activation checkpointing at t = 2 on 2 processes: against full recomputation at t = 2
# with dropout on (the same masks), and against one process with dropout off (TINY: the session reference).
T2_FULL = ["--tensor-model-parallel-size", "2", "--recompute-granularity", "full"]
DISTRIBUTE = [*T2_FULL, "--distribute-saved-activations"]
PLAN = {"dropout": (1, DROPOUT_ON), **{f"dropout-{k}": (1, [*DROPOUT_ON, *v]) for k, v in RECOMPUTE.items()},
        "selective-2222": (8, SELECTIVE_2222), "t2-full-dropout": (2, [*DROPOUT_ON, *T2_FULL]),
        "t2-distributed-dropout": (2, [*DROPOUT_ON, *DISTRIBUTE]), "t2-distributed": (2, DISTRIBUTE),
        "t2-distributed-block": (2, [*DISTRIBUTE, "--recompute-method", "block", "--recompute-num-layers", "3"])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("recompute"), PLAN)


@pytest.mark.parametrize("name", RECOMPUTE)
def test_single_process_with_dropout_matches_and_keeps_less(runs, name):
    """Dropout on: the same training proves the recomputed masks are the original ones, end to end."""
    got, want = runs[f"dropout-{name}"], runs["dropout"]
    assert_equivalent(got, want, RTOL)
    assert got.records[0]["peak_activation_bytes"] < want.records[0]["peak_activation_bytes"]


def test_selective_in_interleaved_2222_matches_single_process(runs, reference):
    assert_equivalent(runs["selective-2222"], reference, RTOL)


def test_distributed_saved_activations_match_one_process(runs, reference):
    """Loss and gradient norm per iteration, final weights: one process's (TINY, dropout off)."""
    assert_equivalent(runs["t2-distributed"], reference, RTOL)
    assert_equivalent(runs["t2-distributed-block"], reference, RTOL)


def test_distributed_saved_activations_keep_one_tth_of_each_layer_input(runs):
    """With dropout on (the recompute must replay the masks of t = 2 full recomputation) the same training,
    and the kept layer inputs are 1/t: exactly (1 - 1/t) of 4 units' s·b·h fp32 inputs less saved, one
    microbatch in flight (p = 1)."""
    got, want = runs["t2-distributed-dropout"], runs["t2-full-dropout"]
    assert_equivalent(got, want, 1e-6)
    s, b, h, units, t = 16, 2, 32, 4, 2
    saved = [r["peak_activation_bytes"] for r in (want.records[0], got.records[0])]
    assert saved[0] - saved[1] == units * s * b * h * 4 * (t - 1) // t, saved
