"""Sequence parallelism's column-parallel linear keeps only its sharded input for backward.

Two gloo ranks: ``sequence_parallel_linear`` on this rank's s/t tokens equals gather-then-linear bit for
bit (output, input gradient, weight and bias gradients), with the weight gradient computed at once and
deferred to a zero-bubble W pass; and the tensors autograd saves for it are the shard (b·s/t·h) and the
weight, not the gathered b·s·h input that gather-then-linear keeps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import pooled_spawn

from ptdp.ops.weight_grad import defer_weight_grads
from ptdp.parallel.collectives import gather_from_sequence_parallel_region
from ptdp.parallel.sequence.linear import sequence_parallel_linear

B, S, H, OUT = 3, 8, 6, 10


def saved_bytes(fn) -> tuple[torch.Tensor, int]:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total


def _check(rank: int, world: int) -> None:
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    full_x = torch.randn(B, S, H, generator=g)
    weight0, bias0 = torch.randn(OUT, H, generator=g), torch.randn(OUT, generator=g)
    grad_out = torch.randn(B, S, OUT, generator=g)
    shard = full_x.chunk(world, dim=1)[rank].contiguous()

    def run(new: bool, defer: bool = False):
        x = shard.clone().requires_grad_()
        w, b = weight0.clone().requires_grad_(), bias0.clone().requires_grad_()
        if new:
            y, saved = saved_bytes(lambda: sequence_parallel_linear(x, w, b, group))
        else:
            y, saved = saved_bytes(lambda: F.linear(gather_from_sequence_parallel_region(x, group), w, b))
        if defer:
            with defer_weight_grads([w, b]) as store:
                y.backward(grad_out)
            assert w.grad is None and len(store) == 1
            store.run()
        else:
            y.backward(grad_out)
        return y.detach(), x.grad, w.grad, b.grad, saved

    ref = run(new=False)
    for defer in (False, True):
        got = run(new=True, defer=defer)
        for a, e in zip(got[:4], ref[:4], strict=True):
            assert torch.equal(a, e)
        # autograd keeps the shard (B·S/t·H) and the weight, not the gathered B·S·H input
        assert got[4] == 4 * (shard.numel() + weight0.numel()), got[4]
    assert ref[4] >= 4 * full_x.numel()


def test_sequence_parallel_linear_saves_shard_and_matches(tmp_path):
    pooled_spawn(_check, 2, tmp_path)
