"""The reducer of each ``--data-parallel-sharding-strategy`` (Megatron-LM's names), and how one is built:
a :class:`~.buffer.FlatBuffer` holding what the strategy keeps (its :meth:`storage`), the reducer over it,
and -- ``--num-distributed-optimizer-instances`` K > 1 -- hybrid sharding's composition around it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from ptdp.parallel.collectives import group_size
from ptdp.parallel.data import zero_layers
from ptdp.parallel.data.buffer import BucketLayout, FlatBuffer
from ptdp.parallel.data.hybrid import Hybrid
from ptdp.parallel.data.protocol import GradReducer
from ptdp.parallel.data.reducer import Gatherer, NoShard, Optim, OptimGrads
from ptdp.parallel.data.zero import ChunkParamSync, OptimGradsParams

REDUCERS: dict[str, type[NoShard]] = {
    "no_shard": NoShard,  # DDP: all-reduce
    "optim": Optim,  # ZeRO-1: reduce-scatter, all-gather the parameters after the step
    "optim_grads": OptimGrads,  # ZeRO-2: + transient full gradients, persistent gradient shards
    "optim_grads_params": OptimGradsParams,  # ZeRO-3: + parameter shards gathered per chunk
}


@dataclass(frozen=True)
class DataParallelGroup:
    """Where a set of parameters' gradients are reduced."""

    group: object  # the ranks a bucket is sharded over (dp-cp; one instance of it under hybrid sharding)
    replicas: object = None  # hybrid sharding: the ranks holding the same shard in the other instances
    divisor: int | None = None  # the sum is divided by this (default: every rank of both groups)


@dataclass(frozen=True)
class GatherPlan:
    """How ZeRO-3 gathers: per chunk at the points of the action list (``reshard_after_forward``: freed
    whenever the rank turns to another chunk), or -- ``layers`` given: one chunk and no pipeline -- per
    transformer layer (``ptdp.parallel.data.zero_layers``). Called with the reducer, it builds the gatherer."""

    reshard_after_forward: bool = False
    layers: tuple[nn.Module, ...] = ()

    def __call__(self, grads: GradReducer) -> ChunkParamSync:
        if self.layers:  # (looked up now: benchmarks/zero.py swaps the class)
            return zero_layers.LayerParamSync(grads, list(self.layers))
        return ChunkParamSync(grads, self.reshard_after_forward)


def build_reducer(strategy: str, params: Iterable[nn.Parameter], layout: BucketLayout, dp: DataParallelGroup, *,
                  overlap: bool = False, gather: Gatherer | None = None) -> GradReducer:
    """The ``strategy``'s reducer of ``params`` over ``dp``, their buffer laid out by ``layout``;
    ``overlap``: --overlap-grad-reduce; ``gather``: ZeRO-3's gatherer (a :class:`GatherPlan`), built if the
    reducer ends up holding parameter shards."""
    group, replicas = dp.group, dp.replicas
    divisor = dp.divisor or group_size(group) * group_size(replicas)
    cls = REDUCERS[strategy]
    if group_size(group) == 1:  # nothing to shard over one rank: at most the replicas' all-reduce
        cls, group, replicas = NoShard, group if replicas is None else replicas, None
    buffer = FlatBuffer(params, layout, cls.storage(group, hybrid=replicas is not None))
    if replicas is None:
        return cls(buffer, group, divisor=divisor, overlap=overlap, gather=gather)
    return Hybrid(cls(buffer, group, divisor=divisor, overlap=overlap), replicas, gather)
