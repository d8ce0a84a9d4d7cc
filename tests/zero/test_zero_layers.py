"""ZeRO-3 per-layer gathers with prefetch (p = 1, ``--reshard-after-forward``: ``ptdp.parallel.data.zero_layers``).

The gathers come from module and gradient hooks, not from the action list the NCCL model checks
(``ptdp.simulate.nccl.zero``), so here: on two real gloo ranks fed *different* data, every rank issues
the same all-gathers in the same order (the NCCL condition) under every recomputation setting, forward
and backward, over two microbatches and an evaluation forward; prefetch keeps at most two layers
gathered, actually issues each layer's gather before the layer is entered, and leaves the reduced
gradients bit-identical to the synchronous gathers. (Equivalence with one process through ``ptdp train``:
``tests/zero/test_zero.py``, ``z3-*-reshard-per-layer*``.)
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from helpers import pooled_spawn

from ptdp.config import ModelConfig
from ptdp.models import GPTModel
from ptdp.parallel.data.buffer import BucketLayout
from ptdp.parallel.data.strategy import DataParallelGroup, build_reducer
from ptdp.parallel.data.zero_layers import LayerParamSync
from ptdp.parallel.init import init_parameters
from ptdp.parallel.parallelize import parallelize
from ptdp.parallel.placement import Placements
from ptdp.parallel.tensor import language_model_loss

CFG = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, hidden_dropout=0.0,
                  attention_dropout=0.0)
RECOMPUTE = [{}, {"recompute_granularity": "selective"}, {"recompute_granularity": "full"},
             {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
             {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}]


def _step(rank: int, flags: dict, prefetch: bool) -> tuple[list, int, bool, list[torch.Tensor]]:
    """Two microbatches of training and one evaluation forward; (bucket gathers in issue order, most
    layers gathered at once, whether every layer entry found its gather already issued, reduced shards)."""
    placements = Placements()
    model = parallelize(GPTModel(dataclasses.replace(CFG, **flags), 50, 64), placements)
    init_parameters(model, seed=7, std=0.02, num_layers=CFG.num_layers, placements=placements)
    layout = BucketLayout(16000, param_buffer=True, placements=placements)  # 4k-parameter buckets: they straddle layers
    grads = build_reducer("optim_grads_params", list(model.parameters()), layout, DataParallelGroup(dist.group.WORLD))
    layers = list(model.layers.values())
    sync = LayerParamSync(grads, layers, prefetch=prefetch)
    index = {id(b): k for k, b in enumerate(grads.buckets)}
    order, gather = [], grads.gather_bucket
    grads.gather_bucket = lambda b: (order.append(index[id(b)]), gather(b))[1]
    issued_early = []
    for i, layer in enumerate(layers):  # runs before the sync's own pre-hook: was the gather issued?
        layer.register_forward_pre_hook(lambda _m, _a, i=i: issued_early.append(
            all(b.param_data.untyped_storage().nbytes() for b in sync._units[i])), prepend=True)
    data = torch.Generator().manual_seed(100 + rank)  # different data per rank: the order must not care
    grads.start_iteration(2)
    sync.gather(0)
    sync.wait(0)
    for _ in range(2):
        tokens = torch.randint(0, 50, (2, CFG.seq_length + 1), generator=data)
        language_model_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    sync.reduce_grads(0)
    sync.release(0)
    grads.finish_grad_sync()
    with torch.no_grad():  # evaluation: forward only, every layer released after its forward
        sync.gather(0)
        sync.wait(0)
        model(tokens[:, :-1])
        sync.release(0)
    assert all(b.param_data.untyped_storage().nbytes() == 0 for b in grads.buckets)  # all freed again
    return order, sync.peak_layers, all(issued_early), [b.own_grad.clone() for b in grads.buckets]


def _check(rank: int, world: int) -> None:
    for flags in RECOMPUTE:
        runs = {prefetch: _step(rank, flags, prefetch) for prefetch in (True, False)}
        for prefetch, (order, peak, early, _shards) in runs.items():
            everyone = [None] * world
            dist.all_gather_object(everyone, order)
            assert all(o == order for o in everyone), (flags, prefetch, "gather order differs across ranks")
            limit = 2 if prefetch or flags.get("recompute_num_layers") == 2 else 1
            assert peak == limit, (flags, prefetch, peak)
            assert early == prefetch, (flags, prefetch)  # prefetch: every layer's gather issued before use
        for a, b in zip(runs[True][3], runs[False][3], strict=True):
            assert torch.equal(a, b), flags  # prefetching moves communication, never a number
        assert any(s.abs().sum() > 0 for s in runs[True][3])


def test_layer_gathers_are_prefetched_identically_on_every_rank(tmp_path):
    pooled_spawn(_check, 2, tmp_path)
