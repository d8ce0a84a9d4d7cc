"""Sequence parallelism: same losses as one process, alone and inside a (t, p, d, v) = (2, 2, 2, 2) pipeline."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from helpers import assert_equivalent, pooled_spawn, run_layouts

from ptdp.config import Config, derive, validate
from ptdp.models import GPTModel
from ptdp.parallel.init import init_parameters
from ptdp.parallel.parallelize import parallelize
from ptdp.parallel.placement import Placements
from ptdp.parallel.sequence.grads import all_reduce_tp_partial_grads
from ptdp.parallel.tensor import language_model_loss, model_parallel_seed
from ptdp.runtime.startup import startup_warnings

RTOL = 1e-4
LAYOUT_2222 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
               "--virtual-pipeline-model-parallel-size", "2", "--sequence-parallel"]
PLAN = {
    "t2": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "interleaved-2222": (8, LAYOUT_2222),
    "interleaved-2222-full-recompute": (8, [*LAYOUT_2222, "--recompute-granularity", "full"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("sp"), PLAN)


@pytest.mark.parametrize("name", PLAN)
def test_layouts_match_single_process(runs, reference, name):
    assert_equivalent(runs[name], reference, RTOL)


def _layernorm_grads(rank: int, world_size: int, out: str) -> None:
    """t=2 with sequence parallelism: after the all-reduce, LayerNorm/bias grads equal one process's."""
    from ptdp.config import ModelConfig

    cfg = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=8,
                      hidden_dropout=0.0, attention_dropout=0.0)
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    grads = {}
    for name, group, sp in (("full", None, False), ("sp", dist.group.WORLD, True)):
        placements = Placements()
        model = parallelize(GPTModel(cfg, 50, 64), placements, tp_group=group, sequence_parallel=sp)
        init_parameters(model, seed=3, std=0.02, num_layers=cfg.num_layers, placements=placements)
        model_parallel_seed(1, rank if group else 0, 0, torch.device("cpu"))
        language_model_loss(model(tokens[:, :-1]), tokens[:, 1:], group).backward()
        if sp:
            all_reduce_tp_partial_grads(model.parameters(), group, placements)
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters() if not placements[p].split_over_tp}
    marked = [n for n, p in model.named_parameters() if "tp" in placements[p].partial_over]
    assert len(marked) == 2 * 6 + 2  # per layer: 2 LayerNorms x (weight, bias) + 2 row-parallel biases
    for n, g in grads["full"].items():
        torch.testing.assert_close(grads["sp"][n], g, rtol=1e-5, atol=1e-7, msg=n)
    torch.save(True, f"{out}.{rank}")


def test_replicated_grads_after_all_reduce_equal_single_process(tmp_path):
    pooled_spawn(_layernorm_grads, 2, tmp_path, str(tmp_path / "ok"))
    assert all((tmp_path / f"ok.{r}").exists() for r in range(2))


def _errors(world: int, **parallel) -> list[str]:
    config = Config()
    config.parallel = dataclasses.replace(config.parallel, **parallel)
    return validate(config, world)


def test_t1_warns_and_turns_it_off(capsys):
    """As in Megatron-LM: a configuration moved to t = 1 keeps working, sequence parallelism off."""
    config = Config()
    config.parallel = dataclasses.replace(config.parallel, sequence_parallel=True)
    assert validate(config, 1) == []
    assert config.parallel.sequence_parallel is True  # validate is pure: derive turns it off
    derived = derive(config)
    assert derived.parallel.sequence_parallel is False and config.parallel.sequence_parallel is True
    assert capsys.readouterr().err == ""  # derive prints nothing: the start-up checks say it
    assert startup_warnings(config, derived) == ["--sequence-parallel is off because --tensor-model-parallel-size is 1"]


def test_sequence_must_split_evenly():
    config = Config()
    config.model.seq_length, config.model.num_attention_heads = 127, 4
    config.parallel.tensor_model_parallel_size, config.parallel.sequence_parallel = 2, True
    errors = validate(config, 2)
    assert len(errors) == 1 and "--seq-length 127 is not divisible" in errors[0], errors
