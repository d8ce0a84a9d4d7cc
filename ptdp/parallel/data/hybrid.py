"""Hybrid sharding (``--num-distributed-optimizer-instances K``, Megatron-LM's flag): the d·c ranks of a
data-parallel (dp-cp) group form K *instances* of d·c/K consecutive ranks. ZeRO shards within an instance
(reduce-scatter, all-gather: fast links inside a node) and the K instances are replicas of each other: a
reduced shard is all-reduced once more over the K ranks that hold the same shard (slow links across nodes
carry only 1/(d·c/K) of the gradients). Parameters and optimizer state cost d·c/K-fold less, not d·c-fold.

:class:`Hybrid` is that composition: any sharded reducer over the instance group (its sum divided by all
d·c replicas, its buffers kept whole until the step: ``OptimGrads.storage(hybrid=True)``), then one
all-reduce of each reduced shard over the replica group. With one rank per instance there is nothing to
shard: the strategy table (``ptdp.parallel.data.strategy``) gives a plain all-reduce over the replicas.
"""

from __future__ import annotations

import torch.distributed as dist

from ptdp.observability import communication
from ptdp.parallel.data.protocol import GradReducer
from ptdp.parallel.data.reducer import Composite, Gatherer


class Hybrid(Composite):
    """``inner`` (sharded over one instance) + the replicas' all-reduce of its shards (Megatron's order)."""

    def __init__(self, inner: GradReducer, replica_group, gather: Gatherer | None = None):
        self.replica_group = replica_group
        super().__init__([inner], gather)

    def finish_grad_sync(self) -> None:
        super().finish_grad_sync()
        group = self.replica_group
        handles = [communication.all_reduce(b.shard, group=group, async_op=True, action="hybrid_grads")
                   for b in self.buckets]
        for handle in handles:
            handle.wait()


def instance_groups(state, k: int) -> tuple[object, object]:
    """(this rank's instance group, this rank's replica group) for ``k`` instances; every rank creates
    every group, in the same order (``torch.distributed.new_group`` is collective)."""
    dims = state.dims
    n = dims.dp * dims.cp
    size = n // k
    mine_instance = mine_replica = None
    for pp_rank in range(dims.pp):
        for tp_rank in range(dims.tp):
            ranks = [dims.rank_of(pp_rank, dp, tp_rank, cp) for dp in range(dims.dp) for cp in range(dims.cp)]
            for i in range(k):
                members = ranks[i * size:(i + 1) * size]
                group = dist.new_group(members)
                if state.rank in members:
                    mine_instance = group
            for j in range(size):
                members = ranks[j::size]
                group = dist.new_group(members)
                if state.rank in members:
                    mine_replica = group
    return mine_instance, mine_replica


def expert_instance_groups(expert, rank: int, k: int) -> tuple[object, object]:
    """The same split of every expert-data-parallel group (``ExpertParallel.dims.groups("edp")``): its edp
    ranks form ``k`` instances of edp/k consecutive ranks, and the ranks holding the same expert shard in
    the k instances a replica group. Collective over the world, like :func:`instance_groups`."""
    mine_instance = mine_replica = None
    for ranks in expert.dims.groups("edp"):
        size = len(ranks) // k
        for i in range(k):
            members = ranks[i * size:(i + 1) * size]
            group = dist.new_group(members)
            if rank in members:
                mine_instance = group
        for j in range(size):
            members = ranks[j::size]
            group = dist.new_group(members)
            if rank in members:
                mine_replica = group
    return mine_instance, mine_replica
