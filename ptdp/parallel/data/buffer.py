"""Flat gradient (and parameter) buffers, reduced over the data-parallel group bucket by bucket.

Megatron's ``ParamAndGradBuffer``: every parameter's gradient ``param.main_grad`` is a view into one
flat buffer per bucket, so the data-parallel reduction is one collective per bucket, and gradient
accumulation over microbatches happens in place. With 16-bit parameters and ``grad_dtype=float32``
(``--accumulate-allreduce-grads-in-fp32``, always on with ``--bf16``) autograd's 16-bit ``param.grad``
is added into the fp32 ``main_grad`` by a post-accumulate hook after each microbatch; otherwise
``param.grad`` *is* ``main_grad`` and autograd accumulates straight into the buffer.

With the distributed optimizer (ZeRO-1) each bucket is padded to a multiple of d and DP rank r owns the
contiguous ``r``-th 1/d of it: the bucket is reduce-scattered instead of all-reduced, and the updated
parameters come back through an all-gather of the flat parameter buffer (``param.data`` is a view into
it). See ptdp-facts.md, §Communication ("one all-reduce, or reduce-scatter + all-gather") and §Memory.

Both collectives run *in place* (Megatron's layout: a rank's shard is a view of the bucket), so ZeRO-1
holds no buffer beside the flat parameter and gradient buffers: per rank, model states are exactly what
the formulas say (:mod:`ptdp.optim.memory` counts them). On the GPU they are NCCL's in-place
reduce-scatter and all-gather. gloo (CPU) has neither natively: its reduce-scatter all-reduces a full-size
copy of the input and its all-gather stages the output in a full-size temporary, both kept alive by the
returned work object, so on the CPU the reduction is the same all-reduce done in place on the bucket
(bit for bit what gloo's reduce-scatter computes) and the parameters come back by one in-place broadcast
per shard (the all-gather's volume, no temporary).

ZeRO-2 and -3 (``--data-parallel-sharding-strategy optim_grads|optim_grads_params``, :mod:`ptdp.parallel.data.zero`)
add two persistent per-bucket tensors, ``grad_shard`` and ``param_shard``: this rank's 1/d of the bucket.
A bucket's full ``grad_data`` is *transient*: allocated when its first gradient of the iteration arrives
(microbatches accumulate into it), reduced once its last microbatch's gradients are in, and freed as soon as
that reduction is done and the shard copied out (:meth:`GradBuckets._retire`); buckets a later sync reads
whole (tied embedding, sequence-parallel parameters) and hybrid sharding keep it until
:meth:`GradBuckets.keep_grad_shards`. Under ZeRO-3 the
full ``param_data`` is allocated only while a chunk's parameters are gathered (``param.data`` stays a view
of it: freeing is ``untyped_storage().resize_(0)``, as PyTorch FSDP1 does, so views survive a re-gather).
Buckets never span two model chunks (``chunk_of``), so a chunk's parameters are gathered by its own buckets.

With ``overlap_grad_reduce`` a bucket's collective is launched asynchronously from the backward hook as
soon as every parameter in it has received its gradient of the iteration's *last* microbatch (the
hooks count backward passes per parameter), so the DP communication hides behind the remaining backward.

Vocabulary-parallel slices (placement role ``vocab``, ``ptdp.parallel.vocab.stage``) get their gradients
outside autograd, in the S/T and EB passes, which add into ``main_grad`` after calling
:meth:`GradBuckets.allocate_main_grad` (a transient bucket's arrival). No hook ever counts them, so their buckets
-- their own, so the rest of chunk 0 still overlaps -- are reduced only after their last contribution:
in :meth:`finish_grad_sync`, or by ZeRO-3's per-chunk reduction after EB (``pipeline.param_sync``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ptdp.observability import flight_recorder
from ptdp.ops.weight_grad import grad_deferred
from ptdp.parallel.collectives import all_gather_single, group_rank, group_size, reduce_scatter_single
from ptdp.parallel.init import DeferredInit
from ptdp.parallel.placement import Placements


@dataclass
class Bucket:
    """A flat run of parameters; ``offsets[i]`` is where ``params[i]`` starts in ``grad_data``."""

    params: list[nn.Parameter]
    offsets: list[int]
    grad_data: torch.Tensor  # padded to a multiple of the shard count
    param_data: torch.Tensor | None  # model parameters as one flat buffer (distributed optimizer)
    shard_start: int  # this rank's owned range [shard_start, shard_end) of the buffer
    shard_end: int
    pending: int = 0  # parameters still waiting for their last-microbatch gradient
    handle: dist.Work | None = None
    shard_out: torch.Tensor | None = field(default=None, repr=False)  # unused: the reduction is in place
    synced: bool = False  # reduced this iteration (its handle waited for and dropped)
    chunk: int = 0  # the model chunk (local index) whose parameters this bucket holds
    grad_shard: torch.Tensor | None = field(default=None, repr=False)  # ZeRO-2/3: persistent reduced shard
    param_shard: torch.Tensor | None = field(default=None, repr=False)  # ZeRO-3: persistent parameter shard
    transient: bool = False  # ZeRO-2/3: grad_data exists only from its first gradient to its reduction

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


class GradBuckets:
    """Gradient buffers for ``params``, averaged over ``dp_group`` (all-reduce, or reduce-scatter with
    ``distributed_optimizer``). ``separate`` parameters (the shared embedding) get a bucket of their own,
    so the first and last pipeline stage shard them the same way (Megatron does the same)."""

    def __init__(self, params: Iterable[nn.Parameter], dp_group, bucket_bytes: int, *,
                 grad_dtype: torch.dtype | None = None, distributed_optimizer: bool = False,
                 param_buffer: bool = False, overlap_grad_reduce: bool = False,
                 separate: Iterable[nn.Parameter] = (), average_over: int | None = None,
                 shard_grads: bool = False, chunk_of: dict[int, int] | None = None, replica_group=None,
                 shard_params: bool = False, placements: Placements | None = None,
                 deferred: DeferredInit | None = None):
        self.params = [p for p in params if p.requires_grad]
        placements = Placements() if placements is None else placements  # vocab slices, SP: the docstring
        self._deferred = DeferredInit() if deferred is None else deferred  # drawn in _make_bucket
        self.dp_group = dp_group  # the group shards are spread over (one instance's under hybrid sharding)
        self.dp_size = group_size(dp_group)
        self.replica_group = replica_group  # hybrid sharding: the same shard in the other instances
        self.replicas = group_size(replica_group) if replica_group is not None else 1
        self.shard_grads = shard_grads and distributed_optimizer and self.dp_size > 1  # ZeRO-2 and -3
        self.shard_params = shard_params and self.shard_grads and param_buffer  # ZeRO-3 (ptdp.parallel.data.zero)
        # The sum is divided by this (the data replicas of the loss): d·c for expert grads reduced over the
        # expert-DP group, which holds fewer ranks (ptdp.parallel.expert.grads); all replicas otherwise.
        self.divisor = self.dp_size * self.replicas if average_over is None else average_over
        self.distributed_optimizer = distributed_optimizer
        self.shard_count = self.dp_size if distributed_optimizer else 1
        self.shard_index = group_rank(dp_group) if distributed_optimizer else 0
        self.overlap_grad_reduce = overlap_grad_reduce and self.dp_size * self.replicas > 1
        self._dp_ranks = [r if dp_group is None else dist.get_global_rank(dp_group, r) for r in range(self.dp_size)] \
            if distributed_optimizer and self.dp_size > 1 else []
        self.buckets: list[Bucket] = []
        self.param_sync = None  # ZeRO-3: the per-chunk gatherer the executor drives (ptdp.parallel.data.zero)
        self._bucket_of: dict[nn.Parameter, Bucket] = {}
        self._backward_count: dict[nn.Parameter, int] = {}
        self._expected_backwards: int | None = None
        separate_ids = {id(p) for p in separate}
        # Megatron fills buckets in reverse order: the last layers' grads are ready first, so go first.
        run: list[nn.Parameter] = []
        chunk_of = chunk_of or {}
        for p in reversed(self.params):
            if run and chunk_of.get(id(p), 0) != chunk_of.get(id(run[-1]), 0):  # never across two chunks
                self._make_bucket(run, grad_dtype, param_buffer)
                run = []
            if id(p) in separate_ids or placements.has_role(p, "vocab"):  # own bucket: see the docstring
                self._make_bucket(run, grad_dtype, param_buffer)
                self._make_bucket([p], grad_dtype, param_buffer)
                run = []
                continue
            run.append(p)
            if sum(q.numel() * q.element_size() for q in run) >= bucket_bytes:
                self._make_bucket(run, grad_dtype, param_buffer)
                run = []
        self._make_bucket(run, grad_dtype, param_buffer)
        for bucket in self.buckets:
            bucket.chunk = chunk_of.get(id(bucket.params[0]), 0)
        self.buffers = [b.grad_data for b in self.buckets]  # kept for callers of the old API
        self._copy_to_main = {p for p in self.params if p.main_grad.dtype != p.dtype}
        # ZeRO-2/3 without hybrid sharding: a bucket's full gradient lives only while it is needed (see
        # :meth:`_arrive`), except where a later sync reads the whole buffer (tied embedding, SP params).
        self._launched: list[Bucket] = []
        for bucket in self.buckets if self.shard_grads and self.replicas == 1 else ():
            bucket.transient = not any(id(p) in separate_ids or placements.sequence_parallel(p)
                                       for p in bucket.params)
        self._per_bucket = self.overlap_grad_reduce or any(b.transient for b in self.buckets)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params
                       if p in self._copy_to_main or self._per_bucket]
        self._hooks += [p.register_hook(self._arrival_hook(p)) for p in self.params
                        if self._bucket_of[p].transient]

    def _make_bucket(self, params: list[nn.Parameter], grad_dtype: torch.dtype | None, param_buffer: bool) -> None:
        if not params:
            return
        first = params[0]
        numel = sum(p.numel() for p in params)
        padded = -(-numel // self.shard_count) * self.shard_count
        grad_data = torch.zeros(padded, dtype=grad_dtype or first.dtype, device=first.device)
        param_data = torch.zeros(padded, dtype=first.dtype, device=first.device) if param_buffer else None
        shard = padded // self.shard_count
        bucket = Bucket(list(params), [], grad_data, param_data, self.shard_index * shard,
                        (self.shard_index + 1) * shard)
        offset = 0
        for p in params:
            bucket.offsets.append(offset)
            if param_data is not None:
                view = param_data[offset:offset + p.numel()].view_as(p)
                init = self._deferred.pop(p)  # ptdp.parallel.init.defer_init: drawn here
                if init is not None:
                    init(view)
                else:
                    view.copy_(p.detach())
                p.data = view
            p.main_grad = grad_data[offset:offset + p.numel()].view_as(p)
            p.grad = p.main_grad if p.main_grad.dtype == p.dtype else None
            offset += p.numel()
            self._bucket_of[p] = bucket
        if self.shard_grads:  # ZeRO-2/3: never the whole model's gradients at once, not even at set-up
            free_storage(grad_data)  # (re)allocated per bucket: _arrive, or zero() for the kept ones
        if self.shard_params:  # ZeRO-3: keep this rank's shard, so at most one bucket is ever whole here
            bucket.param_shard = param_data[bucket.shard_start:bucket.shard_end].clone()
            free_storage(param_data)
        self.buckets.append(bucket)

    # -- one iteration ---------------------------------------------------------------------------------

    def start_iteration(self, num_microbatches: int) -> None:
        """Zero the gradients; the hooks launch a bucket's reduction on its ``num_microbatches``-th backward."""
        self.zero()
        self._expected_backwards = num_microbatches
        self._backward_count = dict.fromkeys(self.params, 0)
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)

    def zero(self) -> None:
        for bucket in self.buckets:
            if bucket.transient:  # allocated (zeroed) when its first gradient arrives: _arrive
                free_storage(bucket.grad_data)
            else:
                alloc_storage(bucket.grad_data)  # ZeRO-2/3 freed it after the last step
                bucket.grad_data.zero_()
            bucket.handle = None
            bucket.synced = False
        self._launched = []

    def allocate_main_grad(self, param: nn.Parameter) -> None:
        """Before a gradient is added into ``param.main_grad`` outside autograd (the vocabulary passes):
        a transient bucket gets its buffer first."""
        self._arrive(self._bucket_of[param])

    def _arrival_hook(self, param: nn.Parameter):
        bucket = self._bucket_of[param]

        def hook(grad: torch.Tensor) -> None:  # runs before autograd accumulates ``grad`` into main_grad
            self._arrive(bucket)

        return hook

    @staticmethod
    @torch.no_grad()
    def _arrive(bucket: Bucket) -> None:
        """Give a transient bucket its (zeroed) full buffer if this iteration has not yet: the views
        ``param.main_grad``/``param.grad`` survive the free (FSDP1's storage trick), so autograd and the
        deferred weight-gradient passes accumulate into them unchanged."""
        if alloc_storage(bucket.grad_data):
            bucket.grad_data.zero_()

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if grad_deferred(param):  # zero-bubble I: no grad yet, it comes (and counts) in W
            return
        if param in self._copy_to_main:  # this microbatch's 16-bit grad -> the fp32 main_grad
            param.main_grad.add_(param.grad)
            param.grad = None
        if not self._per_bucket or self._expected_backwards is None:
            return
        self._backward_count[param] += 1
        if self._backward_count[param] == self._expected_backwards:
            bucket = self._bucket_of[param]
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        """Average over DP (the loss is a mean over the global batch) with one async collective."""
        if bucket.handle is not None or bucket.synced:
            return
        if bucket.transient:
            self._arrive(bucket)  # no gradient reached it (unused parameters): reduce zeros
        if self.dp_size * self.replicas == 1:
            if self.divisor != 1:  # nothing to reduce, still the average
                bucket.grad_data.div_(self.divisor)
                bucket.synced = True
            return
        bucket.grad_data.div_(self.divisor)
        if self.dp_size == 1:  # hybrid sharding with one rank per instance: only the replicas' all-reduce
            bucket.handle = dist.all_reduce(bucket.grad_data, group=self.replica_group, async_op=True)
            return
        if self.distributed_optimizer and bucket.grad_data.device.type != "cpu":
            bucket.handle = reduce_scatter_single(bucket.shard, bucket.grad_data, group=self.dp_group,
                                                  async_op=True)
        else:  # gloo: reduce-scatter is an all-reduce of a copy; this one is in place (module docstring)
            flight_recorder.record("all_reduce", group=self.dp_group, tensor=bucket.grad_data, action="dp_grads")
            bucket.handle = dist.all_reduce(bucket.grad_data, group=self.dp_group, async_op=True)
        if bucket.transient:  # one bucket in flight behind the backward: the earlier ones are done with
            for earlier in self._launched:
                self._retire(earlier)
            self._launched = [bucket]

    @torch.no_grad()
    def _retire(self, bucket: Bucket) -> None:
        """Wait for a transient bucket's reduction, keep its shard and free the full buffer."""
        if bucket.handle is not None:
            bucket.handle.wait()
            bucket.handle, bucket.synced = None, True
        if bucket.grad_data.untyped_storage().nbytes() == 0:
            return
        if bucket.grad_shard is None:
            bucket.grad_shard = torch.empty_like(bucket.shard)
        bucket.grad_shard.copy_(bucket.shard)
        free_storage(bucket.grad_data)

    def finish_grad_sync(self) -> None:
        """Launch the buckets the hooks did not (all of them without overlap) and wait for every one.

        Afterwards ``main_grad`` holds the DP average: everywhere after an all-reduce, and on this rank's
        shard only after a reduce-scatter (the rest of the buffer is stale and must not be read).
        """
        for bucket in self.buckets:
            self._launch(bucket)
        for bucket in self.buckets:
            if bucket.transient:
                self._retire(bucket)
            if bucket.handle is None:
                continue
            bucket.handle.wait()
            bucket.handle, bucket.synced = None, True  # a work object may pin the collective's buffers
        if self.replicas > 1 and self.dp_size > 1:  # hybrid: the instances' shards are summed (Megatron)
            handles = [dist.all_reduce(b.shard, group=self.replica_group, async_op=True) for b in self.buckets]
            for handle in handles:
                handle.wait()
        self._expected_backwards = None

    def launch_chunk(self, chunk: int) -> None:
        """Start the reduction of ``chunk``'s buckets (ZeRO-3: after its last weight-gradient pass)."""
        for bucket in self.buckets:
            if bucket.chunk == chunk:
                self._launch(bucket)

    @torch.no_grad()
    def keep_grad_shards(self) -> None:
        """ZeRO-2/3: copy each reduced shard out and free the full gradient buffer (the optimizer calls it
        after every gradient sync of the step, the tied-embedding and sequence-parallel ones included)."""
        if not self.shard_grads:
            return
        for bucket in self.buckets:
            self._retire(bucket)

    def all_reduce(self) -> None:
        """The whole DP reduction at once (the pre-overlap API): same as :meth:`finish_grad_sync`."""
        self.finish_grad_sync()

    def launched(self) -> list[bool]:
        """Per bucket, whether its reduction is already in flight (tests check the overlap with it)."""
        return [b.handle is not None or b.synced for b in self.buckets]

    # -- distributed optimizer: parameters back from their owners ---------------------------------------

    def all_gather_params(self) -> None:
        """Every DP rank's updated shard of every parameter bucket, to every DP rank."""
        if not self.distributed_optimizer or self.dp_size == 1:
            return
        for handle in [h for b in self.buckets if b.param_shard is None for h in self.gather_bucket(b)]:
            handle.wait()

    def gather_bucket(self, b: Bucket) -> list:
        """Start the all-gather of bucket ``b``'s parameters from every rank's shard; returns the works.

        Under ZeRO-3 the full buffer is (re)allocated first and filled from the persistent shards. The
        in-place writes keep the buffer's autograd version: a chunk's parameters are saved for its
        backward and gathered again, unchanged, before it (FSDP's reshard-after-forward).
        """
        handles = []
        keep_version = torch.autograd._unsafe_preserve_version_counter(b.param_data) \
            if b.param_shard is not None else contextlib.nullcontext()
        with torch.no_grad(), keep_version:
            if b.param_shard is not None:
                alloc_storage(b.param_data)
                b.param_data[b.shard_start:b.shard_end].copy_(b.param_shard)
            if b.param_data.device.type != "cpu":  # in place: this rank's shard is a view of the output
                own = b.param_data[b.shard_start:b.shard_end]
                handles.append(all_gather_single(b.param_data, own, group=self.dp_group, async_op=True))
                return handles
            size = b.shard_end - b.shard_start  # gloo: one broadcast per owner (module docstring)
            for r in range(self.dp_size):
                flight_recorder.record("broadcast", group=self.dp_group, tensor=b.param_data[:size],
                                       action="zero_params")
                handles.append(dist.broadcast(b.param_data[r * size:(r + 1) * size], src=self._dp_ranks[r],
                                              group=self.dp_group, async_op=True))
        return handles
