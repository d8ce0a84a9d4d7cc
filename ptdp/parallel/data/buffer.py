"""Flat gradient (and parameter) buffers cut into buckets: the storage the data-parallel reducers work on.

Megatron's ``ParamAndGradBuffer``: every parameter's gradient ``param.main_grad`` is a view into one
flat tensor per bucket, so the data-parallel reduction is one collective per bucket, and gradient
accumulation over microbatches happens in place. With 16-bit parameters and an fp32 gradient dtype
(``--accumulate-allreduce-grads-in-fp32``, always on with ``--bf16``) autograd's 16-bit ``param.grad``
is added into the fp32 ``main_grad`` by a post-accumulate hook after each microbatch; otherwise
``param.grad`` *is* ``main_grad`` and autograd accumulates straight into the buffer. With a parameter
buffer (fp32 main parameters kept by the optimizer) ``param.data`` is a view of a flat tensor too, and a
parameter created without storage (``ptdp.parallel.init.defer_init``) is drawn straight into its view.

This module holds no strategy: *which* storage lives when is a :class:`Storage` record the reducer of the
``--data-parallel-sharding-strategy`` asks for (``ptdp.parallel.data.strategy``), and *what* is reduced
over which group is the reducers' (``ptdp.parallel.data.reducer``, ``.zero``, ``.hybrid``):

* ``shards`` > 1 (every sharded strategy): each bucket is padded to a multiple of the shard count and this
  rank owns the contiguous ``index``-th piece of it (``Bucket.shard``), what its optimizer steps on;
* ``grad_shards`` (ZeRO-2/3): between steps only ``grad_shard``, a copy of this rank's reduced piece, is
  kept; the full ``grad_data`` is freed at build time, so the whole model's gradients never exist at once;
* ``transient`` (ZeRO-2/3 without hybrid sharding): a bucket's full ``grad_data`` is allocated when its
  first gradient of the iteration arrives (an autograd pre-hook, or :meth:`FlatBuffer.ensure_grad` for
  gradients added outside autograd) and freed once reduced (:meth:`FlatBuffer.keep_shard`) -- except the
  buckets a later synchronisation reads whole (the tied embedding, sequence-parallel parameters);
* ``param_shards`` (ZeRO-3): only ``param_shard`` is kept; ``param_data`` is allocated while its chunk is
  gathered (``param.data`` stays a view of it: freeing is ``untyped_storage().resize_(0)``, as PyTorch
  FSDP1 does, so views survive a re-gather). Sharded bucket by bucket at build time: start-up never
  holds a whole chunk.

Parameters that do not train (LoRA's frozen base) get no gradient storage and no bucket in ``buckets``;
under ZeRO-3 they get parameter-only buckets of their own (``FlatBuffer.frozen_buckets``), sharded like the
rest and gathered with their chunk, never reduced or stepped.

What the buffer needs to know of a parameter it reads from the rank's registries, handed in with the
:class:`BucketLayout`: its placement (``ptdp.parallel.placement``: vocabulary slices, sequence-parallel
parameters) and, for a parameter created without storage, its initialiser (``ptdp.parallel.init.DeferredInit``).

Buckets are filled in reverse order (the last layers' gradients are ready first), never span two model
chunks (``BucketLayout.chunk_of``: ZeRO-3 gathers a chunk by its own buckets), and the tied embedding's
copies (``BucketLayout.separate``, so the first and last stage shard them alike, as Megatron does) and
vocabulary-parallel slices (placement role ``vocab``) get a bucket of their own: their gradients come
outside autograd (the S/T and EB passes of ``ptdp.parallel.vocab.stage``, which call
:meth:`FlatBuffer.allocate_main_grad` first), no hook counts them, and the rest of chunk 0 still overlaps.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ptdp.ops.weight_grad import grad_deferred
from ptdp.parallel.init import DeferredInit
from ptdp.parallel.placement import Placements


@dataclass
class Bucket:
    """A flat run of parameters; ``offsets[i]`` is where ``params[i]`` starts in ``grad_data``."""

    params: list[nn.Parameter]
    offsets: list[int]
    grad_data: torch.Tensor  # padded to a multiple of the shard count
    param_data: torch.Tensor | None  # model parameters as one flat buffer (main parameters kept apart)
    shard_start: int  # this rank's owned range [shard_start, shard_end) of the buffer
    shard_end: int
    shards: int = 1  # how many ranks own a piece of it
    chunk: int = 0  # the model chunk (local index) whose parameters this bucket holds
    shard_grads: bool = False  # ZeRO-2/3: between steps only ``grad_shard`` is kept
    transient: bool = False  # ZeRO-2/3: grad_data exists only from its first gradient to its reduction
    grad_shard: torch.Tensor | None = field(default=None, repr=False)  # ZeRO-2/3: persistent reduced shard
    param_shard: torch.Tensor | None = field(default=None, repr=False)  # ZeRO-3: persistent parameter shard
    # The reducer's book-keeping for the current iteration:
    pending: int = 0  # parameters still waiting for their last-microbatch gradient
    handle: dist.Work | None = None  # the reduction in flight
    synced: bool = False  # reduced this iteration (its handle waited for and dropped)

    @property
    def shard(self) -> torch.Tensor:
        """This rank's owned slice of ``grad_data`` (a view: the in-place reduce-scatter's output)."""
        return self.grad_data[self.shard_start:self.shard_end]

    @property
    def own_grad(self) -> torch.Tensor:
        """This rank's reduced gradient shard: the persistent copy under ZeRO-2/3, else a view of the bucket."""
        return self.grad_shard if self.grad_shard is not None else self.shard

    @property
    def own_param(self) -> torch.Tensor:
        """This rank's parameter shard (model dtype), readable without gathering anything."""
        if self.param_shard is not None:
            return self.param_shard
        return self.param_data[self.shard_start:self.shard_end]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(``params`` | ``grads``, tensor) for every tensor this bucket holds (memory accounting)."""
        if self.param_data is not None:
            yield "params", self.param_data
        yield "grads", self.grad_data
        if self.param_shard is not None:
            yield "params", self.param_shard
        if self.grad_shard is not None:
            yield "grads", self.grad_shard


def free_storage(t: torch.Tensor) -> None:
    """Release ``t``'s memory; views of it stay valid objects (FSDP1's trick) until :func:`alloc_storage`."""
    t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> bool:
    """Give ``t`` its memory back (contents undefined); False if it already had it."""
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() == nbytes:
        return False
    t.untyped_storage().resize_(nbytes)
    return True


@dataclass(frozen=True)
class BucketLayout:
    """How parameters are cut into buckets, whatever the strategy, and the registries that say what each
    parameter is (``placements``: vocabulary slices get a bucket of their own, sequence-parallel gradients
    are read whole later; ``deferred``: the initialisers of parameters created without storage, drawn
    straight into their views of the parameter buffer)."""

    bucket_bytes: int  # a bucket closes once its parameters reach this many bytes (--grad-bucket-size-mb)
    grad_dtype: torch.dtype | None = None  # of main_grad (None: the parameter's)
    param_buffer: bool = False  # param.data becomes a view of a flat parameter buffer
    chunk_of: Mapping[int, int] = field(default_factory=dict)  # id(param) -> its model chunk (default 0)
    separate: frozenset[int] = frozenset()  # ids of parameters with a bucket of their own (tied embedding)
    placements: Placements = field(default_factory=Placements, compare=False)  # a plain model: none recorded
    deferred: DeferredInit = field(default_factory=DeferredInit, compare=False)


@dataclass(frozen=True)
class Storage:
    """What the buffer keeps, and when (the module docstring): chosen by the reducer's strategy."""

    shards: int = 1
    index: int = 0  # this rank's shard
    grad_shards: bool = False
    transient: bool = False
    param_shards: bool = False


class FlatBuffer:
    """The buckets of ``params`` (those that require a gradient) laid out by ``layout``, held as ``storage``."""

    def __init__(self, params: Iterable[nn.Parameter], layout: BucketLayout, storage: Storage = Storage()):
        params = list(params)
        self.params = [p for p in params if p.requires_grad]
        self.layout, self.storage = layout, storage
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[nn.Parameter, Bucket] = {}
        for run in self._runs(self.params):
            self._make_bucket(run)
        # ZeRO-3 shards the frozen weights too (LoRA's base): parameter shards, gathered with their chunk's
        # buckets, but no gradient buffer, no optimizer piece, no reduction (``frozen_buckets``, not ``buckets``)
        self.frozen_buckets: list[Bucket] = []
        if storage.param_shards and layout.param_buffer:
            for run in self._runs([p for p in params if not p.requires_grad]):
                self._make_frozen_bucket(run)
        self._copy_to_main = {p for p in self.params if p.main_grad.dtype != p.dtype}
        for p in self.params:
            if p in self._copy_to_main:
                p.register_post_accumulate_grad_hook(self._accumulate_main)
            if self.bucket_of[p].transient:
                p.register_hook(functools.partial(self._arrival, self.bucket_of[p]))

    def _runs(self, params: list[nn.Parameter]) -> Iterator[list[nn.Parameter]]:
        """The parameters of each bucket, in reverse order (the last layers' gradients are ready first)."""
        chunk_of, run = self.layout.chunk_of, []
        for p in reversed(params):
            if run and chunk_of.get(id(p), 0) != chunk_of.get(id(run[-1]), 0):  # never across two chunks
                yield run
                run = []
            if id(p) in self.layout.separate or self.layout.placements.has_role(p, "vocab"):
                if run:
                    yield run
                yield [p]
                run = []
                continue
            run.append(p)
            if sum(q.numel() * q.element_size() for q in run) >= self.layout.bucket_bytes:
                yield run
                run = []
        if run:
            yield run

    def _make_bucket(self, params: list[nn.Parameter]) -> None:
        first, storage, layout = params[0], self.storage, self.layout
        numel = sum(p.numel() for p in params)
        padded = -(-numel // storage.shards) * storage.shards
        grad_data = torch.zeros(padded, dtype=layout.grad_dtype or first.dtype, device=first.device)
        param_data = torch.zeros(padded, dtype=first.dtype, device=first.device) if layout.param_buffer else None
        shard = padded // storage.shards
        bucket = Bucket(list(params), [], grad_data, param_data, storage.index * shard, (storage.index + 1) * shard,
                        shards=storage.shards, chunk=layout.chunk_of.get(id(first), 0),
                        shard_grads=storage.grad_shards)
        offset = 0
        for p in params:
            bucket.offsets.append(offset)
            if param_data is not None:
                view = param_data[offset:offset + p.numel()].view_as(p)
                init = layout.deferred.pop(p)  # ptdp.parallel.init.defer_init: drawn here
                if init is not None:
                    init(view)
                else:
                    view.copy_(p.detach())
                p.data = view
            p.main_grad = grad_data[offset:offset + p.numel()].view_as(p)
            p.grad = p.main_grad if p.main_grad.dtype == p.dtype else None
            offset += p.numel()
            self.bucket_of[p] = bucket
        bucket.transient = storage.transient and not any(id(p) in layout.separate
                                                          or layout.placements.partial_over(p, "tp") for p in params)
        if storage.grad_shards:  # never the whole model's gradients at once, not even at set-up
            free_storage(grad_data)  # (re)allocated per bucket: ensure_grad, or zero() for the kept ones
        if storage.param_shards:  # keep this rank's shard, so at most one bucket is ever whole here
            bucket.param_shard = param_data[bucket.shard_start:bucket.shard_end].clone()
            free_storage(param_data)
        self.buckets.append(bucket)

    @torch.no_grad()
    def _make_frozen_bucket(self, params: list[nn.Parameter]) -> None:
        """A bucket of frozen parameters: a flat parameter buffer, of which this rank keeps its shard."""
        first, storage, layout = params[0], self.storage, self.layout
        padded = -(-sum(p.numel() for p in params) // storage.shards) * storage.shards
        param_data = torch.zeros(padded, dtype=first.dtype, device=first.device)
        shard = padded // storage.shards
        bucket = Bucket(list(params), [], param_data.new_empty(0), param_data, storage.index * shard,
                        (storage.index + 1) * shard, shards=storage.shards, chunk=layout.chunk_of.get(id(first), 0))
        offset = 0
        for p in params:
            bucket.offsets.append(offset)
            view = param_data[offset:offset + p.numel()].view_as(p)
            init = layout.deferred.pop(p)
            if init is not None:
                init(view)
            else:
                view.copy_(p.detach())
            p.data = view
            offset += p.numel()
        bucket.param_shard = param_data[bucket.shard_start:bucket.shard_end].clone()
        free_storage(param_data)
        self.frozen_buckets.append(bucket)

    def _accumulate_main(self, param: nn.Parameter) -> None:
        """This microbatch's 16-bit ``param.grad`` into the fp32 ``main_grad``."""
        if grad_deferred(param):  # zero-bubble I: no grad yet, it comes in W
            return
        param.main_grad.add_(param.grad)
        param.grad = None

    def _arrival(self, bucket: Bucket, grad: torch.Tensor) -> None:
        """Runs before autograd accumulates ``grad`` into ``main_grad``: the bucket must be there."""
        self.ensure_grad(bucket)

    def allocate_main_grad(self, param: nn.Parameter) -> None:
        """Before a gradient is added into ``param.main_grad`` outside autograd (the vocabulary passes):
        its bucket gets its buffer first (:meth:`ensure_grad`)."""
        self.ensure_grad(self.bucket_of[param])

    @staticmethod
    @torch.no_grad()
    def ensure_grad(bucket: Bucket) -> None:
        """Give a transient bucket its (zeroed) full buffer if this iteration has not yet: the views
        ``param.main_grad``/``param.grad`` survive the free (FSDP1's storage trick), so autograd and the
        deferred weight-gradient passes accumulate into them unchanged."""
        if alloc_storage(bucket.grad_data):
            bucket.grad_data.zero_()

    def zero(self) -> None:
        """Zero the gradients for a new iteration (transient buckets: freed until their first gradient)."""
        for bucket in self.buckets:
            if bucket.transient:
                free_storage(bucket.grad_data)
            else:
                alloc_storage(bucket.grad_data)  # ZeRO-2/3 freed it after the last step
                bucket.grad_data.zero_()

    @staticmethod
    @torch.no_grad()
    def keep_shard(bucket: Bucket) -> None:
        """ZeRO-2/3: copy this rank's reduced piece out to ``grad_shard`` and free the full gradient."""
        if bucket.grad_data.untyped_storage().nbytes() == 0:
            return
        if bucket.grad_shard is None:
            bucket.grad_shard = torch.empty_like(bucket.shard)
        bucket.grad_shard.copy_(bucket.shard)
        free_storage(bucket.grad_data)
