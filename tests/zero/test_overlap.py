"""--overlap-grad-reduce: bucket reductions start inside the last microbatch's backward, same numbers."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from helpers import LAYOUT_2222, assert_equivalent, pooled_spawn, run_layouts
from torch import nn

from ptdp.parallel.data.buffer import BucketLayout
from ptdp.parallel.data.strategy import DataParallelGroup, build_reducer

RTOL = 1e-4


def deep_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]).to(dtype)


def _check_launch_points(rank: int, world: int, dtype: torch.dtype, distributed_optimizer: bool) -> None:
    model = deep_model(dtype)
    plain_model = copy.deepcopy(model)
    strategy = "optim" if distributed_optimizer else "no_shard"
    # one bucket per layer (weight + bias: 72 elements), the last layer's first (Megatron's reverse order)
    layout = BucketLayout(72 * model[0].weight.element_size(), torch.float32, param_buffer=True)
    world = DataParallelGroup(dist.group.WORLD)
    overlapped = build_reducer(strategy, list(model.parameters()), layout, world, overlap=True)
    plain = build_reducer(strategy, list(plain_model.parameters()), layout, world)
    assert len(overlapped.buckets) == 4
    seen: list[list[bool]] = []  # launch state when the first layer's weight (the last grad) arrives
    model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(overlapped.launched()))
    torch.manual_seed(1 + rank)
    inputs = [torch.randn(3, 8, dtype=dtype) for _ in range(3)]
    for grads, net in ((overlapped, model), (plain, plain_model)):
        grads.start_iteration(len(inputs))
        for x in inputs:
            (net(x).float().square().mean() / len(inputs)).backward()
            if grads is overlapped and len(seen) < len(inputs):
                assert overlapped.launched() == [False] * 4, "launched before the last microbatch"
        grads.finish_grad_sync()
    # Microbatches 1 and 2: nothing in flight. Last: the later layers' buckets are already reducing while
    # the backward is still computing the first layer's gradients.
    assert seen[0] == seen[1] == [False] * 4
    assert seen[2][:3] == [True, True, True]
    for a, b in zip(overlapped.buckets, plain.buckets, strict=True):
        own = slice(a.shard_start, a.shard_end)
        assert torch.equal(a.grad_data[own], b.grad_data[own])


def _check_both_paths(rank: int, world: int) -> None:
    _check_launch_points(rank, world, torch.float32, distributed_optimizer=False)  # all-reduce
    _check_launch_points(rank, world, torch.bfloat16, distributed_optimizer=True)  # fp32 main grads, reduce-scatter


def test_buckets_launch_during_last_backward(tmp_path):
    pooled_spawn(_check_both_paths, 2, tmp_path)


OVERLAP = ["--overlap-grad-reduce", "--grad-bucket-size-mb", "0.01"]
LAYOUTS = {"d2": (2, OVERLAP), "t2p2d2v2-distopt": (8, [*OVERLAP, *LAYOUT_2222, "--use-distributed-optimizer"])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("overlap"), LAYOUTS)


@pytest.mark.parametrize("name", LAYOUTS)
def test_overlap_matches_single_process(runs, reference, name):
    assert_equivalent(runs[name], reference, RTOL)
