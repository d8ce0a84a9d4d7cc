"""``local_shards()``: this rank's pieces of every parameter and of its optimizer state, read without
communication under ZeRO-3 (the parameters themselves are freed), disjoint across DP ranks and covering
every parameter; their values are the gathered parameters' and the optimizer's."""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers import pooled_spawn
from torch import nn

from ptdp.config import OptimizerConfig
from ptdp.optim import DistributedOptimizer
from ptdp.parallel.data.buffer import BucketLayout
from ptdp.parallel.data.strategy import DataParallelGroup, GatherPlan, build_reducer
from ptdp.parallel.data.zero import full_parameters


def _check(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3))
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = list(model.parameters())
    grads = build_reducer("optim_grads_params", params, BucketLayout(40, param_buffer=True),
                          DataParallelGroup(dist.group.WORLD), gather=GatherPlan())
    opt = DistributedOptimizer(grads, OptimizerConfig(lr=1e-2), 0, [dist.group.WORLD], None)
    assert all(p.untyped_storage().nbytes() == 0 for p in params)  # only the shards are held
    sync = grads.param_sync  # a ChunkParamSync, built with the reducer
    grads.start_iteration(1)
    sync.wait(0)
    model(torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))).square().mean().backward()
    sync.reduce_grads(0)
    sync.release(0)
    grads.finish_grad_sync()
    opt.step()
    shards = opt.local_shards()
    assert shards and all(s.state for s in shards)  # Adam moments after one step
    with full_parameters(grads):
        names = {id(p): n for n, p in model.named_parameters()}
        covered = {n: torch.zeros(p.numel(), dtype=torch.int32) for n, p in model.named_parameters()}
        for s in shards:
            name = names[id(s.param)]
            torch.testing.assert_close(s.model, s.param.detach().view(-1)[s.start:s.end], rtol=0, atol=0)
            assert s.main.dtype == torch.float32 and s.state["exp_avg"].shape == s.model.shape
            covered[name][s.start:s.end] += 1
        moved = sum((p.detach() - full[n]).abs().sum().item() for n, p in model.named_parameters())
    assert moved > 0  # the step changed the gathered weights
    for n in covered:
        dist.all_reduce(covered[n])
        assert (covered[n] == 1).all(), n  # disjoint and complete over the DP ranks


def test_local_shards_cover_every_parameter_once(tmp_path):
    pooled_spawn(_check, 2, tmp_path)
