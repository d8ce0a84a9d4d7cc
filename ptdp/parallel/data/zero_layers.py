"""ZeRO-3 with ``--reshard-after-forward`` and one model chunk per rank (no pipeline): gather per layer.

With p = 1 the list's gather plan (``ptdp.schedule.param_sync``) has one chunk, the whole model, so gathering
per chunk would hold every parameter whole through the step (4Ψ beside the 16Ψ/d shards). Here, as
PyTorch FSDP does per wrapped block, each transformer layer's buckets are whole while the layer is used
and freed after: gathered for its forward and freed after it, gathered again when the gradient of its
output arrives (just before its backward) and freed once every parameter of the layer has received its
gradient of that backward. Parameters outside the layers (embedding, final norm, output layer) stay
gathered by the chunk-level WAIT_PARAMS/RELEASE_PARAMS actions (this class's handlers) for the step. A bucket may span two layers:
it is whole while any layer that owns one of its parameters is active (in use or prefetched).

**Prefetch** (``prefetch=True``, the default): each gather is issued asynchronously one layer ahead, in
execution order, so it overlaps the current layer's computation, and at most two layers are whole at a
time (the one computing and the one arriving):

* forward: entering layer i issues layer i+1's gather (layer 0's is issued with the chunk-level gather,
  overlapping the embedding); the last layer is kept after its forward when a backward follows (it is
  the backward's first layer: no release and gather again around the loss);
* backward: the gradient of layer i's output arriving issues layer i-1's gather while i's backward runs;
  layer 0 is kept after its backward (the next microbatch's forward starts with it; the chunk-level
  release at the end of the schedule frees it);
* recomputation (``--recompute-granularity full``) reruns a unit's forward inside its backward; those
  forwards prefetch nothing (the next use is the backward of the layer already whole) and do not release.
  With units of one or two layers the backward prefetch of layer i-1 covers the recomputed unit; a unit
  of k > 2 layers holds k layers whole during its recomputation anyway (its first layers are then gathered
  synchronously). Selective recomputation recomputes inside a layer and changes nothing here.

**NCCL safety.** Every DP rank must issue the same all-gathers (which buckets, what size) in the same
order, or the n-th collective of one rank meets a different n-th collective of another: a hang on NCCL,
garbage or a hang on gloo. The gathers are issued from module forward hooks, output-gradient hooks and
the executor's chunk-level calls, never from data-dependent places: the forward runs the same layers in
program order on every rank, and the backward of a chain of layers is sequential (layer i-1's output
gradient exists only after layer i's backward), so the hooks fire in the same order everywhere. A bucket
is gathered at the first hook that needs it while it is not whole, which depends on that same sequence
only. The decisions read nothing but the layer index, the grad mode and whether autograd is running a
backward -- all rank-independent. ``tests/zero/test_zero_layers.py`` records every rank's gathers, with
different data per rank and every recomputation setting, and checks they are identical (the per-chunk
gathers are modelled in ``ptdp.simulate.nccl.zero``; these are not in the action list, hence the check).
"""

from __future__ import annotations

import torch
from torch import nn

from ptdp.ops.weight_grad import grad_deferred
from ptdp.parallel.data.buffer import Bucket, free_storage
from ptdp.parallel.data.protocol import GradReducer
from ptdp.parallel.data.zero import ChunkParamSync


def _in_backward() -> bool:
    """Whether autograd is running a backward (a recomputed forward runs inside one)."""
    return torch._C._current_graph_task_id() != -1


class LayerParamSync(ChunkParamSync):
    """:class:`ChunkParamSync` whose chunk-level gather covers only the non-layer parameters; the layers'
    buckets are gathered per layer, prefetched one layer ahead unless ``prefetch`` is False."""

    def __init__(self, grads: GradReducer, layers: list[nn.Module], prefetch: bool = True):
        super().__init__(grads, reshard_after_forward=True)
        self.prefetch = prefetch
        bucket_of = {id(p): b for b in grads.buckets if b.param_shard is not None for p in b.params}
        self._units = [[bucket_of[id(p)] for p in layer.parameters() if id(p) in bucket_of] for layer in layers]
        in_layer = {id(p) for layer in layers for p in layer.parameters()}  # a bucket with any other: kept
        self._rest = [b for b in grads.buckets if b.param_shard is not None
                      and any(id(p) not in in_layer for p in b.params)]
        self._rest += grads.frozen_buckets  # frozen weights (LoRA): no gradient marks their layer's end: per chunk
        self._active: set[int] = set()  # layers whose buckets must stay whole (in use, in flight, kept)
        self._handles: dict[int, list] = {}  # id(bucket) -> the works of its all-gather still in flight
        self._pending: list[int] = [0] * len(layers)  # parameters still to receive this backward's grad
        self.peak_layers = 0  # most layers active at once (prefetch: 2)
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda _m, _a, i=i: self._enter(i))
            layer.register_forward_hook(lambda _m, _a, out, i=i: self._after_forward(i, out))
            for p in layer.parameters():
                if id(p) in bucket_of:
                    p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_arrived(i, p))

    def _buckets(self, chunk: int) -> list[Bucket]:
        return self._rest if chunk == 0 and not self._releasing else super()._buckets(chunk)

    _releasing = False

    def gather(self, chunk: int) -> None:
        """The chunk-level gather (start of the schedule's run); with prefetch also layer 0's, which then
        overlaps the embedding's forward."""
        super().gather(chunk)
        if self.prefetch and self._units:
            self._issue(0)

    def release(self, chunk: int) -> None:
        self.wait(chunk)
        for handles in self._handles.values():  # never free a buffer a collective is still writing
            for handle in handles:
                handle.wait()
        self._handles.clear()
        self._releasing = True
        try:
            super().release(chunk)
        finally:
            self._releasing = False
        self._active.clear()

    def _issue(self, i: int) -> None:
        """Start the all-gather of layer ``i``'s buckets that are neither whole nor in flight."""
        self._active.add(i)
        self.peak_layers = max(self.peak_layers, len(self._active))
        for b in self._units[i]:
            if b.param_data.untyped_storage().nbytes() == 0:  # allocated by gather_bucket: issued once
                self._handles[id(b)] = self.grads.gather_bucket(b)

    def _wait(self, i: int) -> None:
        """Layer ``i`` whole: its gathers issued (now, if nobody prefetched them) and completed."""
        self._issue(i)
        for b in self._units[i]:
            for handle in self._handles.pop(id(b), ()):
                handle.wait()

    def _release_unit(self, i: int) -> None:
        self._active.discard(i)
        keep = {id(b) for j in self._active for b in self._units[j]} | {id(b) for b in self._rest}
        for b in self._units[i]:
            if id(b) not in keep and b.param_data.untyped_storage().nbytes():
                for handle in self._handles.pop(id(b), ()):
                    handle.wait()
                free_storage(b.param_data)

    def _enter(self, i: int) -> None:
        self._issue(i)
        if self.prefetch and not _in_backward() and i + 1 < len(self._units):
            self._issue(i + 1)  # forward: the next layer arrives while this one computes
        self._wait(i)
        if torch.is_grad_enabled():
            self._pending[i] = len(self._units[i])

    def _after_forward(self, i: int, out) -> None:
        if _in_backward():  # recomputation inside the backward: keep it whole for the backward
            return
        first = out[0] if isinstance(out, tuple) else out
        backward_follows = isinstance(first, torch.Tensor) and first.requires_grad
        if not (self.prefetch and backward_follows and i == len(self._units) - 1):
            self._release_unit(i)  # (the last layer is the backward's first: kept when prefetching)
        if backward_follows:
            first.register_hook(lambda _g, i=i: self._before_backward(i))

    def _before_backward(self, i: int) -> None:
        """The gradient of layer ``i``'s output has arrived: its backward (or recomputation) is next."""
        self._issue(i)
        if self.prefetch and i > 0:
            self._issue(i - 1)  # the previous layer arrives while this one's backward runs
        self._wait(i)

    def _grad_arrived(self, i: int, p: nn.Parameter) -> None:
        if grad_deferred(p) or i not in self._active:
            return
        self._pending[i] -= 1
        if self._pending[i] == 0 and not (self.prefetch and i == 0):  # layer 0: the next forward's first
            self._release_unit(i)
