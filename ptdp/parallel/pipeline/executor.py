"""The one loop over a pipeline schedule: ``run_schedule(actions, stage, comm)``.

Schedules are data (``ptdp.parallel.pipeline.schedules``); this module runs any such list on a ``PipelineStage``
(what to compute) and a ``P2PComm`` (how tensors travel). The list says where communication happens:
each run of consecutive SEND/RECV actions is ONE batched p2p call, issued where it stands, and a received
tensor is waited on only by the compute that consumes it. The lists are placed so that this cannot hang
under NCCL's ordering (``schedules.place_communication``, checked by ``nccl_model``), and transfers overlap
the computes between a message's post and its consumer. ``ModuleStage`` is the autograd implementation of a
stage: one ``nn.Module`` per local model chunk.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from ptdp.observability.clock import Clock, Mark, seconds
from ptdp.ops.weight_grad import WeightGradStore, defer_weight_grads
from ptdp.parallel.data.param_sync import plan_param_sync
from ptdp.parallel.pipeline.p2p import P2PComm, PendingRecv, message_key
from ptdp.schedule.actions import COMM_OPS, Action, virtual_stage
from ptdp.schedule.vocab import VOCAB_COLLECTIVES, VOCAB_COMPUTE

VOCAB_OPS = VOCAB_COLLECTIVES | VOCAB_COMPUTE


class PipelineStage(Protocol):
    """What one pipeline rank computes; chunk is the LOCAL chunk index (see schedules.virtual_stage)."""

    def forward(self, chunk: int, microbatch: int, input: Tensor | None) -> Tensor | None:
        """``input`` is None on virtual stage 0; return the activation to send (None on the last stage)."""
        ...

    def backward(self, chunk: int, microbatch: int, output_grad: Tensor | None) -> Tensor | None:
        """Full backward; ``output_grad`` None on the last stage. Return the input grad (None on stage 0)."""
        ...

    def backward_input(self, chunk: int, microbatch: int, output_grad: Tensor | None) -> Tensor | None:
        """Input-gradient half of ``backward`` (zero-bubble I); weight grads follow in backward_weight."""
        ...

    def backward_weight(self, chunk: int, microbatch: int) -> None:
        """Weight-gradient half of ``backward`` (zero-bubble W), after backward_input of the same pair."""
        ...


@dataclass
class ScheduleStats:
    """What one rank measured while running its schedule.

    Times are read lazily: on a GPU they are CUDA events (``ptdp.observability.clock``), read when
    ``busy_s``/``idle_s``/``wall_s`` are first asked for, after the caller's one sync of the iteration.
    ``losses`` are detached tensors on the stage's device: reading them is the caller's sync.
    """

    peak_in_flight: int = 0  # (microbatch, chunk) pairs with F done and B/I not yet done, at once
    peak_saved_bytes: int = 0  # bytes saved for backward (saved_tensors_hooks), peak over the schedule
    losses: dict[int, Tensor] = field(default_factory=dict)  # per microbatch, last virtual stage only
    _spans: list = field(default_factory=list, repr=False)  # (category, start mark, end mark); [0] = whole
    _times: tuple[float, float, float] | None = field(default=None, repr=False)

    def _resolve(self) -> tuple[float, float, float]:
        """(busy, idle, wall) seconds."""
        if self._times is None:
            if not self._spans:
                return (0.0, 0.0, 0.0)
            took = [(category, seconds(start, end)) for category, start, end in self._spans[1:]]
            self._times = (sum(s for c, s in took if c == "compute"), sum(s for c, s in took if c == "p2p"),
                           seconds(*self._spans[0][1:]))
            self._spans = []
        return self._times

    @property
    def busy_s(self) -> float:
        """Time in F/B/I/W."""
        return self._resolve()[0]

    @property
    def idle_s(self) -> float:
        """Time the compute stream (CPU: the host) waited for communication."""
        return self._resolve()[1]

    @property
    def wall_s(self) -> float:
        return self._resolve()[2]

    def __getstate__(self) -> dict:  # CUDA events don't pickle: keep the numbers
        self._resolve()
        return {**self.__dict__, "_spans": []}


class ModuleStage:
    """Autograd stage: ``chunks[c]`` is this rank's model chunk c (``schedules.virtual_stage`` with the
    schedule's ``placement``).

    Keeps (input, output) per (chunk, microbatch) between forward and backward and drops them as soon as
    the backward ran, so live activations are exactly what the schedule keeps in flight. On the last
    virtual stage the output goes through ``loss_fn(output, microbatch)`` (already scaled by the caller,
    e.g. 1/m) and the loss is the backward root.
    """

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        rank: int,
        p: int,
        v: int,
        first_input: Callable[[int], Any],
        loss_fn: Callable[[Tensor, int], Tensor],
        placement: str = "loop",
        labels: Callable[[int], Tensor] | None = None,
    ) -> None:
        if len(chunks) != v:
            raise ValueError(f"ModuleStage: got {len(chunks)} model chunks for v={v}")
        self.chunks, self.rank, self.p, self.v = list(chunks), rank, p, v
        self.placement = placement  # schedules.schedule_placement of the schedule that runs this stage
        self.first_input, self.loss_fn = first_input, loss_fn
        self.labels = labels  # given: the last chunk's forward also gets the microbatch's labels (MTP, issue 41)
        self.losses: dict[int, Tensor] = {}
        self._stash: dict[tuple[int, int], tuple[Any, Tensor]] = {}
        self._weight_grad_todo: dict[tuple[int, int], WeightGradStore] = {}

    def is_first(self, chunk: int) -> bool:
        return virtual_stage(self.rank, chunk, self.p, self.placement) == 0

    def is_last(self, chunk: int) -> bool:
        return virtual_stage(self.rank, chunk, self.p, self.placement) == self.p * self.v - 1

    def parameters(self) -> list[nn.Parameter]:
        return [q for c in self.chunks for q in c.parameters()]

    def forward(self, chunk: int, microbatch: int, input: Tensor | None) -> Tensor | None:
        if self.is_first(chunk):
            x = self.first_input(microbatch)
        else:
            x = input.detach().requires_grad_(True)  # a leaf: its .grad is what we send back
        labels = self.labels(microbatch) if self.labels is not None and self.is_last(chunk) else None
        y = self.chunks[chunk](x) if labels is None else self.chunks[chunk](x, labels=labels)
        if self.is_last(chunk):
            y = self.loss_fn(y, microbatch)
            self.losses[microbatch] = y.detach()
            self._stash[chunk, microbatch] = (x, y)
            return None
        self._stash[chunk, microbatch] = (x, y)
        return y

    def backward(self, chunk: int, microbatch: int, output_grad: Tensor | None) -> Tensor | None:
        x, y = self._stash.pop((chunk, microbatch))
        torch.autograd.backward(y, grad_tensors=output_grad)
        return None if self.is_first(chunk) else x.grad

    def backward_input(self, chunk: int, microbatch: int, output_grad: Tensor | None) -> Tensor | None:
        """The whole backward with the linears' and norms' weight grads deferred
        (``ptdp.ops.weight_grad``): the graph is freed here; W keeps only their closures.

        Every other parameter (embeddings, compiled layers) gets its grad here, as in a full B.
        """
        x, y = self._stash.pop((chunk, microbatch))
        with defer_weight_grads(self.chunks[chunk].parameters()) as store:  # this chunk's own store
            torch.autograd.backward(y, grad_tensors=output_grad)
        self._weight_grad_todo[chunk, microbatch] = store
        return None if self.is_first(chunk) else x.grad

    def backward_weight(self, chunk: int, microbatch: int) -> None:
        """Only the deferred wgrad GEMMs and bias/norm reductions, accumulated with autograd's hooks."""
        self._weight_grad_todo.pop((chunk, microbatch)).run()


class _SavedBytes:
    """Bytes of tensors autograd saves for backward, per (microbatch, chunk), one entry per storage.

    A storage counts in full even when only a view of it is saved (SDPA saves q, k and v as views of the
    fused qkv output): the whole storage stays alive until the backward.

    Parameters (and their views) are excluded: they are resident anyway, only activations count.
    """

    def __init__(self, stage: Any) -> None:
        params = stage.parameters() if hasattr(stage, "parameters") else []
        # By storage identity, not address: ZeRO-3 frees and re-allocates a parameter's storage.
        self._ignore = {q.untyped_storage()._cdata for q in params}
        self._live: dict[tuple[int, int], dict[int, int]] = {}
        self.current = self.peak = 0

    def hooks(self, key: tuple[int, int]) -> torch.autograd.graph.saved_tensors_hooks:
        ledger = self._live.setdefault(key, {})

        def pack(t: Tensor) -> Tensor:
            ptr = t.untyped_storage().data_ptr()
            nbytes = t.untyped_storage().nbytes()  # a saved view keeps its whole storage alive
            if t.untyped_storage()._cdata not in self._ignore and nbytes > ledger.get(ptr, 0):
                self.current += nbytes - ledger.get(ptr, 0)
                ledger[ptr] = nbytes
                self.peak = max(self.peak, self.current)
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def free(self, key: tuple[int, int]) -> None:
        self.current -= sum(self._live.pop(key, {}).values())


def run_schedule(
    actions: Sequence[Action],
    stage: PipelineStage,
    comm: P2PComm | None = None,
    recorder: Callable[[str, str, float, float, dict], None] | None = None,
    count_saved_bytes: bool = True,
    param_sync: Any = None,
) -> ScheduleStats:
    """Run one rank's action list. ``comm`` may be None only if the list has no SEND/RECV (p == 1).

    Each run of consecutive SEND/RECV actions goes out as one batched call where it stands in the list;
    a receive is waited on right before the compute that consumes it; sends are waited on at the end.
    Tensors between two virtual stages on the same rank (no SEND/RECV between them) are handed over
    locally. ``recorder(name, category, start, end, args)``, if given, hears of every compute action and
    every wait (``ptdp.observability.timeline``), with ``Clock`` marks.
    ``count_saved_bytes=False`` skips the saved-tensor hooks (``peak_saved_bytes`` is then 0): the
    accounting costs a Python call per saved tensor, and its answer is the same every iteration.
    ``param_sync`` (ZeRO-3, ``ptdp.parallel.data.zero.ChunkParamSync``): its gather/wait/release/reduce run at the
    points ``param_sync.plan_param_sync`` reads off ``actions``, around the compute actions.
    """
    if comm is None and any(a.op in COMM_OPS for a in actions):
        raise ValueError("run_schedule: the schedule has SEND/RECV actions but no comm was given")
    params = stage.parameters() if hasattr(stage, "parameters") else []
    clock = Clock(params[0].device if params else "cpu")
    stats = ScheduleStats()
    spans = stats._spans = [("schedule", clock.mark(), None)]
    saved = _SavedBytes(stage) if count_saved_bytes else None
    sent_keys = {message_key(a) for a in actions if a.op.startswith("SEND")}
    inbox: dict[tuple[str, int, int], Tensor] = {}  # (kind, microbatch, consumer chunk) -> tensor
    outbox: dict[tuple[str, int, int], Tensor] = {}  # (kind, microbatch, producer chunk) -> tensor
    pending: dict[tuple[str, int, int], PendingRecv] = {}
    live: set[tuple[int, int]] = set()
    sync_before, sync_after = ({}, {}) if param_sync is None else \
        plan_param_sync(actions, param_sync.reshard_after_forward)

    def run_sync(ops) -> None:
        for op in ops:
            getattr(param_sync, "reduce_grads" if op.op == "reduce" else op.op)(op.chunk)

    def span(name: str, category: str, start: Mark, mb: int | None = None, chunk: int | None = None) -> None:
        end = clock.mark()
        spans.append((category, start, end))
        if recorder is not None:
            recorder(name, category, start, end, {} if mb is None else {"microbatch": mb, "chunk": chunk})

    def take(key: tuple[str, int, int]) -> Tensor | None:
        if key in pending:
            t0 = clock.mark()
            tensor = comm.wait(pending.pop(key))
            span("wait_recv_activation" if key[0] == "F" else "wait_recv_grad", "p2p", t0, key[1], key[2])
            return tensor
        return inbox.pop(key, None)

    def deliver(kind: str, mb: int, chunk: int, tensor: Tensor | None) -> None:
        if tensor is None:
            return
        if (kind, mb, chunk) in sent_keys:
            outbox[kind, mb, chunk] = tensor.detach()
        else:  # next virtual stage lives on this rank
            consumer = chunk + 1 if kind == "F" else chunk - 1
            if consumer >= 0:  # a stage-0 input grad has no consumer
                inbox[kind, mb, consumer] = tensor

    i = 0
    while i < len(actions):
        a = actions[i]
        if a.op in VOCAB_OPS:  # vocabulary parallelism: the stage issues the collective or computes S/T
            run_sync(sync_before.get(i, ()))  # ZeRO-3: EF/S/T/EB read chunk 0's slices (plan_param_sync)
            t0 = clock.mark()
            stage.collective(a) if a.op in VOCAB_COLLECTIVES else stage.vocab(a)
            if a.op not in VOCAB_COLLECTIVES:
                span(f"vocab_{a.op}", "compute", t0, a.microbatch, a.chunk)
            run_sync(sync_after.get(i, ()))
            i += 1
            continue
        if a.op in COMM_OPS:  # one batched call for this run of SEND/RECV actions
            j = i
            while j < len(actions) and actions[j].op in COMM_OPS:
                j += 1
            batch = actions[i:j]
            sends = [(s, outbox.pop(message_key(s))) for s in batch if s.op.startswith("SEND")]
            pending.update(comm.issue(sends, [r for r in batch if r.op.startswith("RECV")]))
            i = j
            continue
        mb, c = a.microbatch, a.chunk
        if i in sync_before:
            t0 = clock.mark()
            run_sync(sync_before[i])
            span("zero_param_sync", "p2p", t0, mb, c)
        hooks = saved.hooks((mb, c)) if saved is not None else contextlib.nullcontext()
        if a.op == "F":
            x = take(("F", mb, c))
            t0 = clock.mark()
            with hooks:
                y = stage.forward(c, mb, x)
            span("forward", "compute", t0, mb, c)
            live.add((mb, c))
            stats.peak_in_flight = max(stats.peak_in_flight, len(live))
            deliver("F", mb, c, y)
        elif a.op in ("B", "I"):
            g = take(("B", mb, c))
            t0 = clock.mark()
            dx = stage.backward(c, mb, g) if a.op == "B" else stage.backward_input(c, mb, g)
            span("backward" if a.op == "B" else "backward_input", "compute", t0, mb, c)
            if a.op == "B" and saved is not None:
                saved.free((mb, c))
            live.discard((mb, c))
            deliver("B", mb, c, dx)
        elif a.op == "W":
            t0 = clock.mark()
            stage.backward_weight(c, mb)
            span("backward_weight", "compute", t0, mb, c)
            if saved is not None:
                saved.free((mb, c))
        run_sync(sync_after.get(i, ()))
        i += 1

    if comm is not None:
        t0 = clock.mark()
        comm.wait_sends()
        span("wait_sends", "p2p", t0)
    if outbox or pending:
        raise RuntimeError(f"run_schedule: unsent {sorted(outbox)} / unconsumed {sorted(pending)} tensors")
    spans[0] = ("schedule", spans[0][1], clock.mark())
    stats.peak_saved_bytes = saved.peak if saved is not None else 0
    stats.losses = dict(sorted(getattr(stage, "losses", {}).items()))
    return stats
