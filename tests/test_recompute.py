"""Activation recomputation: same numbers as no recomputation (dropout masks included), less memory kept."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from helpers import assert_equivalent, run_layouts

from ptdp.config import Config, ModelConfig, validate
from ptdp.models import GPTModel
from ptdp.parallel import recompute
from ptdp.parallel.init import init_parameters
from ptdp.parallel.parallelize import parallelize
from ptdp.parallel.placement import Placements
from ptdp.parallel.recompute import recompute_plan
from ptdp.parallel.tensor import language_model_loss, model_parallel_seed

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


def _errors(**model_flags) -> list[str]:
    config = Config()
    config.model = dataclasses.replace(config.model, **model_flags)
    return validate(config, 1)


@pytest.mark.parametrize("flags,message", [
    ({"recompute_method": "block"}, "--recompute-method applies only to --recompute-granularity full"),
    ({"recompute_granularity": "selective", "recompute_num_layers": 2},
     "--recompute-num-layers applies only to --recompute-granularity full"),
    ({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 5},
     "--recompute-num-layers 5 must be between 0 and the 4 layers"),
    ({"recompute_granularity": "full", "recompute_num_layers": 0}, "--recompute-num-layers must be >= 1"),
])
def test_bad_recompute_flags_give_one_line(flags, message):
    errors = _errors(**flags)
    assert len(errors) == 1 and message in errors[0], errors


DROPOUT_ON = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
RECOMPUTE = {
    "full": ["--recompute-granularity", "full"],
    "full-block-2": ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"],
    "selective": ["--recompute-granularity", "selective"],
}
# Full recomputation at (2, 2, 2, 2) runs in tests/test_sequence_parallel.py (with sequence parallelism).
SELECTIVE_2222 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                  "--virtual-pipeline-model-parallel-size", "2", "--recompute-granularity", "selective"]
PLAN = {"dropout": (1, DROPOUT_ON), **{f"dropout-{k}": (1, [*DROPOUT_ON, *v]) for k, v in RECOMPUTE.items()},
        "selective-2222": (8, SELECTIVE_2222)}


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
