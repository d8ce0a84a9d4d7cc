"""One reducer per ``--data-parallel-sharding-strategy``, each over a :class:`~.buffer.FlatBuffer`:

* :class:`NoShard` (``no_shard``, DDP): every rank keeps every bucket whole; one all-reduce averages it.
* :class:`Optim` (``optim``, ZeRO-1, ``--use-distributed-optimizer``): each bucket is padded to a multiple of
  d and rank r owns its ``r``-th 1/d; the bucket is reduce-scattered instead of all-reduced, and after the
  step the updated parameters come back through an all-gather of the flat parameter buffer.
* :class:`OptimGrads` (``optim_grads``, ZeRO-2): and a bucket's full gradient exists only from its first
  gradient to its reduction; a copy of this rank's reduced piece is kept (``Bucket.grad_shard``).
* ``optim_grads_params`` (ZeRO-3): and parameters are shards too, gathered per chunk
  (``ptdp.parallel.data.zero.OptimGradsParams``).

Hybrid sharding and a MoE model's two groups are compositions of these (:class:`Composite`,
``ptdp.parallel.data.hybrid.Hybrid``); ``ptdp.parallel.data.strategy`` picks the class from a table.

Both collectives run *in place* (Megatron's layout: a rank's shard is a view of the bucket), so ZeRO-1
holds no buffer beside the flat parameter and gradient buffers (docs/references.md, §Communication: one all-reduce, or a reduce-scatter and an all-gather; and §Memory; ``ptdp.optim.memory`` counts them). On the GPU
they are NCCL's in-place reduce-scatter and all-gather. gloo (CPU) has neither natively: its
reduce-scatter all-reduces a full-size copy of the input and its all-gather stages the output in a
full-size temporary, both kept alive by the returned work object, so on the CPU the reduction is the same
all-reduce done in place on the bucket (bit for bit what gloo's reduce-scatter computes) and the
parameters come back by one in-place broadcast per shard (the all-gather's volume, no temporary).

With ``overlap`` (``--overlap-grad-reduce``), and always under ZeRO-2/3 (whose memory depends on it), a
bucket's collective is launched asynchronously from the backward hook as soon as every parameter in it
has received its gradient of the iteration's *last* microbatch (the hooks count backward passes per
parameter), so the communication hides behind the remaining backward. Vocabulary-parallel slices get
their gradients outside autograd (after :meth:`NoShard.allocate_main_grad`): no hook counts them, so their
buckets are launched by ``finish_grad_sync`` or by ZeRO-3's REDUCE_GRADS after EB.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ptdp.observability import communication
from ptdp.ops.weight_grad import grad_deferred
from ptdp.parallel.collectives import all_gather_single, group_rank, group_size, reduce_scatter_single
from ptdp.parallel.data.buffer import Bucket, FlatBuffer, Storage
from ptdp.parallel.data.protocol import GradReducer, ParamSync

Gatherer = Callable[[GradReducer], ParamSync]  # builds ZeRO-3's gatherer over a reducer (``strategy.GatherPlan``)


class NoShard:
    """``no_shard``: buckets averaged over ``group`` by one all-reduce each (see the module docstring).

    ``divisor``: what the sum is divided by (the data replicas of the loss: the group's size, or d·c for
    expert gradients reduced over the smaller expert-data-parallel group); ``gather``: ZeRO-3's gatherer,
    built over this reducer when it holds parameter shards.
    """

    @classmethod
    def storage(cls, group, hybrid: bool) -> Storage:
        """What the buffer of this strategy keeps over ``group`` (``hybrid``: replicated in instances)."""
        return Storage()

    def __init__(self, buffer: FlatBuffer, group, *, divisor: int | None = None, overlap: bool = False,
                 gather: Gatherer | None = None):
        self.buffer, self.group = buffer, group
        self.buckets, self.params = buffer.buckets, buffer.params
        self.frozen_buckets = buffer.frozen_buckets  # ZeRO-3's shards of frozen weights: gathered, never reduced
        self.size = group_size(group)
        self.divisor = self.size if divisor is None else divisor
        self._expected: int | None = None  # microbatches of this iteration (None: between iterations)
        self._count: dict[nn.Parameter, int] = {}
        self._hooked = (overlap and self.size > 1) or any(b.transient for b in self.buckets)  # per bucket
        if self._hooked:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self.grad_ready)
        self.param_sync: ParamSync | None = None
        if gather is not None and any(b.param_shard is not None for b in (*self.buckets, *self.frozen_buckets)):
            self.param_sync = gather(self)

    # -- one iteration ---------------------------------------------------------------------------------

    def start_iteration(self, num_microbatches: int) -> None:
        self.buffer.zero()
        for bucket in self.buckets:
            bucket.handle, bucket.synced, bucket.pending = None, False, len(bucket.params)
        self._expected = num_microbatches
        if self._hooked:  # the hooks' counts (no Python per parameter per iteration without them)
            self._count = dict.fromkeys(self.params, 0)

    def grad_ready(self, param: nn.Parameter) -> None:
        if grad_deferred(param) or self._expected is None:  # zero-bubble I: it comes (and counts) in W
            return
        self._count[param] = count = self._count.get(param, 0) + 1
        if count == self._expected:
            bucket = self.buffer.bucket_of[param]
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch(bucket)

    def allocate_main_grad(self, param: nn.Parameter) -> None:
        self.buffer.allocate_main_grad(param)

    def launch_chunk(self, chunk: int) -> None:
        for bucket in self.buckets:
            if bucket.chunk == chunk:
                self._launch(bucket)

    def finish_grad_sync(self) -> None:
        for bucket in self.buckets:
            self._launch(bucket)
        for bucket in self.buckets:
            self._wait(bucket)
        self._expected = None

    def keep_grad_shards(self) -> None:
        """Nothing to do: the gradients stay whole between steps."""

    def all_gather_params(self) -> None:
        """Nothing to do: every rank stepped every parameter."""

    def gather_bucket(self, bucket: Bucket) -> list[dist.Work]:
        return []  # never sharded

    def group_of(self, bucket: Bucket):
        return self.group

    def launched(self) -> list[bool]:
        return [b.handle is not None or b.synced for b in self.buckets]

    # -- one bucket -------------------------------------------------------------------------------------

    def _launch(self, bucket: Bucket) -> None:
        """Average over the group (the loss is a mean over the global batch) with one async collective."""
        if bucket.handle is not None or bucket.synced:
            return
        if bucket.transient:
            self.buffer.ensure_grad(bucket)  # no gradient reached it (unused parameters): reduce zeros
        if self.size == 1:  # nothing to reduce, still the average; reduced (a second launch would find a
            if self.divisor != 1:  # retired transient bucket and reduce zeros over its kept shard)
                bucket.grad_data.div_(self.divisor)
            bucket.synced = True
            return
        bucket.grad_data.div_(self.divisor)
        bucket.handle = self._reduce(bucket)

    def _reduce(self, bucket: Bucket) -> dist.Work:
        return communication.all_reduce(bucket.grad_data, group=self.group, async_op=True, action="dp_grads")

    def _wait(self, bucket: Bucket) -> None:
        if bucket.handle is not None:
            bucket.handle.wait()
            bucket.handle, bucket.synced = None, True  # a work object may pin the collective's buffers


class Optim(NoShard):
    """``optim`` (ZeRO-1): reduce-scatter into this rank's shard, all-gather the parameters after the step."""

    @classmethod
    def storage(cls, group, hybrid: bool) -> Storage:
        return Storage(shards=group_size(group), index=group_rank(group))

    def __init__(self, buffer: FlatBuffer, group, **kwargs):
        self._ranks = [r if group is None else dist.get_global_rank(group, r) for r in range(group_size(group))]
        super().__init__(buffer, group, **kwargs)

    def _reduce(self, bucket: Bucket) -> dist.Work:
        if bucket.grad_data.device.type != "cpu":
            return reduce_scatter_single(bucket.shard, bucket.grad_data, group=self.group, async_op=True,
                                         action="dp_grads")
        return super()._reduce(bucket)  # gloo: reduce-scatter is an all-reduce of a copy; this one is in place

    def all_gather_params(self) -> None:
        """Every rank's updated shard of every parameter bucket, to every rank (ZeRO-3's shards excepted:
        the executor gathers those per chunk)."""
        for handle in [h for b in self.buckets if b.param_shard is None for h in self.gather_bucket(b)]:
            handle.wait()

    @torch.no_grad()
    def gather_bucket(self, bucket: Bucket) -> list[dist.Work]:
        """Start the in-place all-gather of ``bucket``'s parameter buffer from its owners' pieces."""
        b = bucket
        if b.param_data.device.type != "cpu":  # in place: this rank's shard is a view of the output
            own = b.param_data[b.shard_start:b.shard_end]
            return [all_gather_single(b.param_data, own, self.group, async_op=True, action="zero_params")]
        size = b.shard_end - b.shard_start  # gloo: one broadcast per owner (module docstring)
        handles = []
        for r in range(self.size):
            handles.append(communication.broadcast(b.param_data[r * size:(r + 1) * size], self._ranks[r],
                                                   group=self.group, async_op=True, action="zero_params"))
        return handles


class OptimGrads(Optim):
    """``optim_grads`` (ZeRO-2): full gradients per bucket, only while needed; persistent gradient shards.

    At most one transient bucket is in flight behind the backward: launching one retires the previous
    (waits for its reduction, keeps its shard, frees it). Under hybrid sharding the buffers are not
    transient (the replicas' all-reduce reads the shards after :meth:`finish_grad_sync`); they are freed by
    :meth:`keep_grad_shards`, which the optimizer calls after every sync of the step.
    """

    @classmethod
    def storage(cls, group, hybrid: bool) -> Storage:
        return Storage(shards=group_size(group), index=group_rank(group), grad_shards=True, transient=not hybrid)

    def __init__(self, buffer: FlatBuffer, group, **kwargs):
        self._launched: list[Bucket] = []
        super().__init__(buffer, group, **kwargs)

    def start_iteration(self, num_microbatches: int) -> None:
        self._launched = []
        super().start_iteration(num_microbatches)

    def keep_grad_shards(self) -> None:
        for bucket in self.buckets:
            self._retire(bucket)

    def _launch(self, bucket: Bucket) -> None:
        if bucket.handle is not None or bucket.synced:
            return
        super()._launch(bucket)
        if bucket.transient:  # one bucket in flight behind the backward: the earlier ones are done with
            for earlier in self._launched:
                self._retire(earlier)
            self._launched = [bucket]

    def _wait(self, bucket: Bucket) -> None:
        if bucket.transient:
            self._retire(bucket)
        else:
            super()._wait(bucket)

    def _retire(self, bucket: Bucket) -> None:
        """Wait for a bucket's reduction, keep its shard and free the full buffer."""
        super()._wait(bucket)
        self.buffer.keep_shard(bucket)


class Composite:
    """Reducers over disjoint parameter subsets, each over its own group, behind the one protocol: a MoE
    model's dense parameters over dp-cp and its experts over expert-data-parallel
    (``ptdp.parallel.expert.grads``); hybrid sharding's instances (``ptdp.parallel.data.hybrid``).

    Every call goes to the parts in order (so the collectives on each group are issued in the same order
    on every member); a bucket's gather and group are its own part's. ZeRO-3's gatherer, if any part holds
    parameter shards, is built over the whole (``gather``; the parts are built without one).
    """

    def __init__(self, parts: list[GradReducer], gather: Gatherer | None = None):
        self.parts = parts
        self.buckets = [b for part in parts for b in part.buckets]
        self.params = [p for part in parts for p in part.params]
        self.frozen_buckets = [b for part in parts for b in part.frozen_buckets]
        self._part_of_bucket = {id(b): part for part in parts for b in (*part.buckets, *part.frozen_buckets)}
        self._part_of_param = {p: part for part in parts for p in part.params}
        self.param_sync: ParamSync | None = None
        if gather is not None and any(b.param_shard is not None for b in (*self.buckets, *self.frozen_buckets)):
            self.param_sync = gather(self)

    def start_iteration(self, num_microbatches: int) -> None:
        for part in self.parts:
            part.start_iteration(num_microbatches)

    def grad_ready(self, param: nn.Parameter) -> None:
        self._part_of_param[param].grad_ready(param)

    def allocate_main_grad(self, param: nn.Parameter) -> None:
        self._part_of_param[param].allocate_main_grad(param)

    def launch_chunk(self, chunk: int) -> None:
        for part in self.parts:
            part.launch_chunk(chunk)

    def finish_grad_sync(self) -> None:
        for part in self.parts:
            part.finish_grad_sync()

    def keep_grad_shards(self) -> None:
        for part in self.parts:
            part.keep_grad_shards()

    def all_gather_params(self) -> None:
        for part in self.parts:
            part.all_gather_params()

    def gather_bucket(self, bucket: Bucket) -> list[dist.Work]:
        return self._part_of_bucket[id(bucket)].gather_bucket(bucket)

    def group_of(self, bucket: Bucket):
        return self._part_of_bucket[id(bucket)].group_of(bucket)

    def launched(self) -> list[bool]:
        return [flag for part in self.parts for flag in part.launched()]
