"""The strategy table and its compositions (``ptdp/parallel/data/strategy.py``): which reducer each
``--data-parallel-sharding-strategy`` and group gives, and that every one of them -- sharded over the
world, hybrid (K = 2), hybrid with one-rank instances (K = d: only the replicas' all-reduce is left), and
a composite of two reducers over different groups (a MoE model's shape) -- leaves in each rank's owned
shard the average no_shard computes. Four gloo ranks, two microbatches each, different data per rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers import pooled_spawn
from torch import nn

from ptdp.parallel.data.buffer import BucketLayout
from ptdp.parallel.data.hybrid import Hybrid
from ptdp.parallel.data.reducer import Composite, NoShard
from ptdp.parallel.data.strategy import REDUCERS, DataParallelGroup, GatherPlan, build_reducer
from ptdp.parallel.data.zero import OptimGradsParams

LAYOUT = BucketLayout(40, param_buffer=True)  # several buckets, parameters cut by shard boundaries
SHARDED = ("optim", "optim_grads", "optim_grads_params")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))


def _train(rank: int, build) -> tuple[nn.Module, object]:
    """One iteration of two microbatches; ``build(params)`` makes the reducer."""
    model = _model()
    grads = build(list(model.parameters()))
    grads.start_iteration(2)
    if grads.param_sync is not None:  # ZeRO-3: the parameters are shards until gathered
        grads.param_sync.wait(0)
    for mb in range(2):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * rank + mb))
        model(x).square().mean().backward()
    if grads.param_sync is not None:
        grads.param_sync.reduce_grads(0)
        grads.param_sync.release(0)
    grads.finish_grad_sync()
    grads.keep_grad_shards()
    return model, grads


def _assert_owned_average(model: nn.Module, grads, reference: nn.Module) -> None:
    """Each bucket's owned range equals the no_shard average of the parameters it covers."""
    want = {id(p): q.main_grad.reshape(-1) for p, q in zip(model.parameters(), reference.parameters(), strict=True)}
    covered = 0
    for b in grads.buckets:
        for p, offset in zip(b.params, b.offsets, strict=True):
            lo, hi = max(offset, b.shard_start), min(offset + p.numel(), b.shard_end)
            if lo < hi:
                got = b.own_grad[lo - b.shard_start:hi - b.shard_start]
                torch.testing.assert_close(got, want[id(p)][lo - offset:hi - offset], rtol=1e-6, atol=1e-7)
                covered += hi - lo
    assert covered > 0


def _check(rank: int, world: int) -> None:
    instances = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    singles = [dist.new_group([r]) for r in range(world)]
    everyone = DataParallelGroup(dist.group.WORLD)
    reference, _ = _train(rank, lambda ps: build_reducer("no_shard", ps, LAYOUT, everyone))
    hybrid = DataParallelGroup(instances[rank // 2], replicas[rank % 2])
    one_rank_instances = DataParallelGroup(singles[rank], dist.group.WORLD)
    for strategy, cls in REDUCERS.items():
        model, grads = _train(rank, lambda ps, s=strategy: build_reducer(s, ps, LAYOUT, everyone, gather=GatherPlan()))
        assert type(grads) is cls and (grads.param_sync is not None) == (strategy == "optim_grads_params")
        assert all(b.shards == (1 if cls is NoShard else world) for b in grads.buckets)
        _assert_owned_average(model, grads, reference)
    for strategy in SHARDED:
        model, grads = _train(rank, lambda ps, s=strategy: build_reducer(s, ps, LAYOUT, hybrid, gather=GatherPlan()))
        assert isinstance(grads, Hybrid) and grads.group_of(grads.buckets[0]) is hybrid.group
        assert all(b.shards == 2 and not b.transient for b in grads.buckets)  # replicas read the shards
        _assert_owned_average(model, grads, reference)
        model, grads = _train(rank, lambda ps, s=strategy: build_reducer(s, ps, LAYOUT, one_rank_instances))
        assert type(grads) is NoShard and grads.group is dist.group.WORLD and grads.param_sync is None
        _assert_owned_average(model, grads, reference)

    def two_groups(params: list[nn.Parameter]) -> Composite:  # the first linear over the world, the rest hybrid
        parts = [build_reducer("optim_grads_params", params[:2], LAYOUT, everyone),
                 build_reducer("optim_grads_params", params[2:], LAYOUT, hybrid)]
        return Composite(parts, GatherPlan())

    model, grads = _train(rank, two_groups)
    assert [type(p) for p in grads.parts] == [OptimGradsParams, Hybrid]
    assert [grads.group_of(b) is dist.group.WORLD for b in grads.buckets].count(True) == len(grads.parts[0].buckets)
    _assert_owned_average(model, grads, reference)


def test_every_strategy_and_composition_reduces_to_the_average(tmp_path):
    pooled_spawn(_check, 4, tmp_path)
