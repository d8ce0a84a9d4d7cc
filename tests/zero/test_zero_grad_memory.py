"""ZeRO-2/3 full gradient buffers are per bucket and transient: a bucket's full gradient is
allocated when its first gradient arrives and freed right after its reduction, so the last backward of a
step never holds the whole model's gradients -- and the reduced shards still equal the DP average of the
gradients accumulated over every microbatch. Two gloo processes, a stack of tiny linears (one bucket each).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import pooled_spawn
from torch import nn

from ptdp.parallel.data.buffer import BucketLayout
from ptdp.parallel.data.strategy import DataParallelGroup, build_reducer

LAYERS, WIDTH, MICRO = 6, 8, 2


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _batch(rank: int, mb: int) -> torch.Tensor:
    return torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(100 * rank + mb))


def _worker(rank: int, world_size: int, out: str) -> None:
    """One rank, in the session's pool (``helpers.pooled_spawn``: the gloo group is up, one thread); what
    it saw goes to ``out/rank{rank}.json``."""
    model = _model()
    grads = build_reducer("optim_grads", model.parameters(), BucketLayout(1), DataParallelGroup(dist.group.WORLD))
    assert len(grads.buckets) == 2 * LAYERS and all(b.transient for b in grads.buckets)
    held: list[int] = []

    def count(_p) -> None:
        held.append(sum(b.grad_data.untyped_storage().nbytes() > 0 for b in grads.buckets))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(count)
    allocated, last_backward = [], []
    for micro in (1, MICRO):  # the second step re-allocates what the first freed, and accumulates
        grads.start_iteration(micro)
        allocated.append(sum(b.grad_data.untyped_storage().nbytes() > 0 for b in grads.buckets))
        for mb in range(micro):
            held.clear()
            model(_batch(rank, mb)).square().sum().backward()
        last_backward.append(list(held))
        grads.finish_grad_sync()
        grads.keep_grad_shards()
    # reference: the average over both ranks of the summed microbatch grads, computed here in full
    ref = _model()
    for r in range(2):
        for mb in range(MICRO):
            ref(_batch(r, mb)).square().sum().backward()
    ref_of = {id(p): q for p, q in zip(model.parameters(), ref.parameters(), strict=True)}
    flat_ref = [torch.cat([ref_of[id(p)].grad.reshape(-1) / 2 for p in b.params]) for b in grads.buckets]
    ok = all(torch.allclose(b.own_grad, torch.nn.functional.pad(f, (0, b.grad_data.numel() - f.numel()))
                            [b.shard_start:b.shard_end], rtol=1e-5, atol=1e-6)
             for b, f in zip(grads.buckets, flat_ref, strict=True))
    seen = {"allocated_at_start": allocated, "last_backward": last_backward, "shards_ok": ok,
            "after_step": sum(b.grad_data.untyped_storage().nbytes() > 0 for b in grads.buckets)}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(seen))


def test_full_gradients_live_per_bucket_and_shards_stay_exact(tmp_path):
    pooled_spawn(_worker, 2, tmp_path, str(tmp_path))
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["shards_ok"], r
        assert r["allocated_at_start"] == [0, 0] and r["after_step"] == 0, r
        single, accumulated = r["last_backward"]
        # one microbatch: at most the bucket accumulating + one reduced in flight, never the whole model
        assert max(single) <= 3 < 2 * LAYERS, r
        # with accumulation every bucket is whole after the first microbatch; the last one frees them
        assert accumulated[0] == 2 * LAYERS and accumulated[-1] <= 2, r
