"""Model states per rank are what ZeRO's and Megatron's formulas say.

Real gloo ranks at d = 1, 2, 4 build the gradient buffers and optimizer ``setup_optimizer`` would, take
a step (Adam's state exists after it), and count the *distinct storages* held by the model, the buffers
and the optimizer (``model_state_bytes``). fp32 must be 8 + 8/d bytes per parameter with the distributed
optimizer and 16 without; bf16 with fp32 gradients 6 + 12/d and 18 -- within one bucket's padding. A
full-size duplicate (the old reduce-scatter output buffer, an unsharded Adam state) would miss by a
whole shard or more, and the counter is shown to see one.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import pooled_spawn
from torch import nn

from ptdp.config import OptimizerConfig
from ptdp.optim import DistributedOptimizer, FP32Optimizer
from ptdp.optim.memory import HeldStates, model_state_bytes, model_state_formula_bytes
from ptdp.parallel.data.buffer import BucketLayout
from ptdp.parallel.data.protocol import GradReducer
from ptdp.parallel.data.strategy import DataParallelGroup, build_reducer

BUCKET_BYTES = 16 * 1024  # several buckets; each pads to a multiple of d


def model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 64), nn.LayerNorm(64), nn.Linear(64, 96), nn.Linear(96, 40)).to(dtype)


def held_after_one_step(dtype: torch.dtype, distributed: bool) -> tuple[dict[str, int], int, GradReducer]:
    net = model(dtype)
    params = list(net.parameters())
    main_params = distributed or dtype != torch.float32
    grads = build_reducer("optim" if distributed else "no_shard", params,
                          BucketLayout(BUCKET_BYTES, torch.float32, param_buffer=main_params),
                          DataParallelGroup(dist.group.WORLD))
    cfg = OptimizerConfig(lr=1e-3)
    opt = (DistributedOptimizer(grads, cfg, 0, [dist.group.WORLD], None) if main_params
           else FP32Optimizer(params, cfg, 0, [dist.group.WORLD]))
    grads.start_iteration(1)
    x = torch.randn(8, 48, dtype=dtype, generator=torch.Generator().manual_seed(dist.get_rank()))
    net(x).float().square().mean().backward()
    grads.finish_grad_sync()
    opt.step()
    return model_state_bytes(params, grads, opt), sum(p.numel() for p in params), grads


def _check(rank: int, world: int) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for distributed in (False, True):
            held, n, grads = held_after_one_step(dtype, distributed)
            formula = model_state_formula_bytes(n, dtype, torch.float32, world, distributed)
            # padding: at most d - 1 elements per bucket, in every buffer (params, grads, main, 2 moments)
            # and Adam's scalar ``step`` per tensor it steps (4 bytes each)
            slack = len(grads.buckets) * (world - 1) * 24 + 4 * 2 * sum(len(b.params) for b in grads.buckets)
            assert 0 <= held["total"] - formula <= slack, (dtype, distributed, world, held, formula)
            owned = (8 + (4 if dtype != torch.float32 else 0)) * n / (world if distributed else 1)
            assert abs(held["optimizer"] - owned) <= slack, (dtype, distributed, held, owned)
    # The counter sees a duplicate: a full-size fp32 copy beside the buffers costs its bytes.
    held, n, grads = held_after_one_step(torch.float32, True)
    params = [p for b in grads.buckets for p in b.params]
    before = model_state_bytes(params, grads, None)
    held_states = HeldStates()  # the loop's reports: walked again when a held tensor is a new object
    assert held_states.total(params, grads, None) == before["total"]
    grads.buckets[0].grad_shard = torch.empty_like(grads.buckets[0].grad_data)
    again = model_state_bytes(params, grads, None)
    assert again["grads"] - before["grads"] == grads.buckets[0].grad_data.numel() * 4
    assert held_states.total(params, grads, None) == again["total"]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_model_state_bytes_match_formulas(tmp_path, world):
    pooled_spawn(_check, world, tmp_path)


def test_formula_values():
    n = 1000
    assert model_state_formula_bytes(n) == 16 * n
    assert model_state_formula_bytes(n, shards=4, distributed=True) == (8 + 2) * n
    assert model_state_formula_bytes(n, torch.bfloat16) == 18 * n
    assert model_state_formula_bytes(n, torch.bfloat16, shards=4, distributed=True) == (6 + 3) * n
    assert model_state_formula_bytes(n, torch.float16, torch.float16, 4, True) == (4 + 4) * n
