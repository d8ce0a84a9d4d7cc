"""ZeRO-3 with ``--reshard-after-forward`` and one model chunk per rank (no pipeline): gather per layer.

With p = 1 the pipeline plan (``ptdp.pipeline.param_sync``) has one chunk, the whole model, so gathering
per chunk would hold every parameter whole through the step (4Ψ beside the 16Ψ/d shards). Here, as
PyTorch FSDP does per wrapped block, each transformer layer's buckets are gathered right before the
layer's forward and freed after it, gathered again when the gradient of the layer's output arrives (just
before its backward) and freed once every parameter of the layer has received its gradient of that
backward. Parameters outside the layers (embedding, final norm, output layer) stay gathered by the
executor's chunk-level ``wait``/``release`` for the step. A bucket may span two layers: it is whole while
any layer that owns one of its parameters is active. Gathers are synchronous (no prefetch), and happen in
the same program order on every DP rank (same graph, same microbatches), so the collectives match.
Recomputation re-runs a layer's forward inside its backward: the release after forward is skipped there.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.weight_grad import grad_deferred
from .grad_buffer import Bucket, GradBuckets, free_storage
from .zero import ChunkParamSync


class LayerParamSync(ChunkParamSync):
    """:class:`ChunkParamSync` whose chunk-level gather covers only the non-layer parameters."""

    def __init__(self, grads: GradBuckets, layers: list[nn.Module]):
        super().__init__(grads, reshard_after_forward=True)
        bucket_of = {id(p): b for b in grads.buckets if b.param_shard is not None for p in b.params}
        self._units = [[bucket_of[id(p)] for p in layer.parameters() if id(p) in bucket_of] for layer in layers]
        in_layer = {id(p) for layer in layers for p in layer.parameters()}  # a bucket with any other: kept
        self._rest = [b for b in grads.buckets if b.param_shard is not None
                      and any(id(p) not in in_layer for p in b.params)]
        self._active: set[int] = set()  # layers whose buckets must stay whole
        self._pending: list[int] = [0] * len(layers)  # parameters still to receive this backward's grad
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda _m, _a, i=i: self._enter(i))
            layer.register_forward_hook(lambda _m, _a, out, i=i: self._after_forward(i, out))
            for p in layer.parameters():
                if id(p) in bucket_of:
                    p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_arrived(i, p))

    def _buckets(self, chunk: int) -> list[Bucket]:
        return self._rest if chunk == 0 and not self._releasing else super()._buckets(chunk)

    _releasing = False

    def release(self, chunk: int) -> None:
        self.wait(chunk)
        self._releasing = True
        try:
            super().release(chunk)
        finally:
            self._releasing = False
        self._active.clear()

    def _gather_unit(self, i: int) -> None:
        self._active.add(i)
        todo = {id(b): b for b in self._units[i] if b.param_data.untyped_storage().nbytes() == 0}
        for handle in [h for b in todo.values() for h in self.grads.gather_bucket(b)]:
            handle.wait()

    def _release_unit(self, i: int) -> None:
        self._active.discard(i)
        keep = {id(b) for j in self._active for b in self._units[j]} | {id(b) for b in self._rest}
        for b in self._units[i]:
            if id(b) not in keep:
                free_storage(b.param_data)

    def _enter(self, i: int) -> None:
        self._gather_unit(i)
        if torch.is_grad_enabled():
            self._pending[i] = len(self._units[i])

    def _after_forward(self, i: int, out) -> None:
        if torch._C._current_graph_task_id() != -1:  # recomputation inside the backward: keep it whole
            return
        self._release_unit(i)
        first = out[0] if isinstance(out, tuple) else out
        if isinstance(first, torch.Tensor) and first.requires_grad:
            first.register_hook(lambda _g, i=i: self._gather_unit(i))

    def _grad_arrived(self, i: int, p: nn.Parameter) -> None:
        if grad_deferred(p) or i not in self._active:
            return
        self._pending[i] -= 1
        if self._pending[i] == 0:
            self._release_unit(i)
