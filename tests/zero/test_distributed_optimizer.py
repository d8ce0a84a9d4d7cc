"""ZeRO-1 (--use-distributed-optimizer) computes torch AdamW's update, whatever the layout.

Unit level: two real gloo ranks shard a small model's AdamW over DP, with buckets that cut parameters
across shard boundaries, and match ``torch.optim.AdamW`` + ``clip_grad_norm_`` on the full batch in one
process; the logical per-parameter state round-trips. End to end: ``ptdp train`` matches one process
(losses and gradient norms) at d = 2 and 4, with t = 2 and sequence parallelism, and in the 2x2x2x2 layout.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from helpers import LAYOUT_2222, assert_equivalent, assert_same_training, pooled_spawn, run_layouts
from torch import nn

from ptdp.config import OptimizerConfig
from ptdp.optim import DistributedOptimizer, build_optimizer
from ptdp.parallel.data.buffer import BucketLayout
from ptdp.parallel.data.strategy import DataParallelGroup, build_reducer

RTOL = 1e-4
CFG = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.05)  # small clip: clipping is active


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3))


def microbatches(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(4, 5, generator=g) for _ in range(4)]  # 4 microbatches, 2 per rank


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def reference_run(steps: int):
    model = tiny_model()
    opt = build_optimizer(list(model.parameters()), CFG)
    for step in range(steps):
        opt.zero_grad()
        for x in microbatches(step):
            (loss_of(model, x) / 4).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CFG.clip_grad)
        opt.step()
    return model, opt


def distributed_run(model: nn.Module, rank: int, steps: int, overlap: bool, first_step: int = 0,
                    state: dict | None = None):
    params = list(model.parameters())
    # 40-byte buckets: several buckets, parameters split between the two ranks' shards
    grads = build_reducer("optim", params, BucketLayout(40, param_buffer=True), DataParallelGroup(dist.group.WORLD),
                          overlap=overlap)
    opt = DistributedOptimizer(grads, CFG, tp_rank=0, norm_groups=[dist.group.WORLD], scaler=None)
    if state is not None:
        opt.load_state_per_param({params[i]: s for i, s in state.items()})
    for step in range(first_step, first_step + steps):
        grads.start_iteration(2)
        for x in microbatches(step)[2 * rank:2 * rank + 2]:
            (loss_of(model, x) / 2).backward()
        grads.finish_grad_sync()
        opt.step()
    return grads, opt


def _check_matches_torch_adamw(rank: int, world: int, overlap: bool) -> None:
    ref_model, ref_opt = reference_run(3)
    model = tiny_model()
    grads, opt = distributed_run(model, rank, 3, overlap)
    assert len(grads.buckets) > 2 and all(b.shard_end - b.shard_start == b.grad_data.numel() // 2 for b in grads.buckets)
    initial = dict(tiny_model().named_parameters())
    assert_same_training(dict(model.named_parameters()), dict(ref_model.named_parameters()), initial)
    # The logical state (gathered over DP) is torch's per-parameter AdamW state.
    states = opt.state_per_param()
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(states[p][key], ref_opt.state[q][key], rtol=1e-5, atol=1e-8)
        assert float(states[p]["step"]) == float(ref_opt.state[q]["step"]) == 3.0
    assert_same_training({n: states[p]["main_param"] for n, p in model.named_parameters()},
                         dict(ref_model.named_parameters()), initial)
    # Resume from the logical state in a fresh optimizer: the next steps are torch's again.
    ref_model, _ = reference_run(5)
    resumed = copy.deepcopy(model)
    by_index = {i: states[p] for i, p in enumerate(model.parameters())}
    distributed_run(resumed, rank, 2, overlap, first_step=3, state=by_index)
    assert_same_training(dict(resumed.named_parameters()), dict(ref_model.named_parameters()), initial)


def _check_with_and_without_overlap(rank: int, world: int) -> None:
    _check_matches_torch_adamw(rank, world, overlap=False)
    _check_matches_torch_adamw(rank, world, overlap=True)


def test_sharded_adamw_equals_torch_adamw(tmp_path):
    pooled_spawn(_check_with_and_without_overlap, 2, tmp_path)


# a small bucket size: several buckets, so parameters straddle the DP shard boundaries
DISTOPT = ["--use-distributed-optimizer", "--grad-bucket-size-mb", "0.01"]
SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
LAYOUTS = {"d2": (2, DISTOPT), "d4": (4, DISTOPT), "t2d2-sequence-parallel": (4, [*DISTOPT, *SP]),
           "t2p2d2v2": (8, [*DISTOPT, *LAYOUT_2222])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("distopt"), LAYOUTS)


@pytest.mark.parametrize("name", LAYOUTS)
def test_distributed_optimizer_matches_single_process(runs, reference, name):
    assert_equivalent(runs[name], reference, RTOL)
    # model states per rank: 8 + 8/d bytes per parameter (fp32), counted from the tensors held
    last = runs[name].records[-1]
    assert last["model_state_bytes"] == max(last["model_state_bytes_per_rank"]) > 0
