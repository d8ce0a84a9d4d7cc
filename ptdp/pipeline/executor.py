"""The one loop over a pipeline schedule: ``run_schedule(actions, stage, comm)``.

Schedules are data (``ptdp.pipeline.schedules``); this module runs any such list on a ``PipelineStage``
(what to compute) and a ``P2PComm`` (how tensors travel). Receives are posted ahead of the compute that
needs them (``recv_lookahead`` compute actions early) together with the pending sends in one batched call,
and waited on only when consumed, so transfers overlap compute. ``ModuleStage`` is the autograd
implementation of a stage: one ``nn.Module`` per local model chunk.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from ptdp.pipeline.p2p import P2PComm, PendingRecv, message_key
from ptdp.pipeline.schedules import COMPUTE_OPS, Action, virtual_stage


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
    """What one rank measured while running its schedule."""

    peak_in_flight: int = 0  # (microbatch, chunk) pairs with F done and B/I not yet done, at once
    peak_saved_bytes: int = 0  # bytes saved for backward (saved_tensors_hooks), peak over the schedule
    busy_s: float = 0.0  # time in F/B/I/W
    idle_s: float = 0.0  # time blocked waiting for communication
    wall_s: float = 0.0
    losses: dict[int, float] = field(default_factory=dict)  # per microbatch, last virtual stage only


class ModuleStage:
    """Autograd stage: ``chunks[c]`` is this rank's model chunk c (virtual stage c*p + rank).

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
    ) -> None:
        if len(chunks) != v:
            raise ValueError(f"ModuleStage: got {len(chunks)} model chunks for v={v}")
        self.chunks, self.rank, self.p, self.v = list(chunks), rank, p, v
        self.first_input, self.loss_fn = first_input, loss_fn
        self.losses: dict[int, Tensor] = {}
        self._stash: dict[tuple[int, int], tuple[Any, Tensor]] = {}
        self._weight_grad_todo: dict[tuple[int, int], Tensor | None] = {}

    def is_first(self, chunk: int) -> bool:
        return virtual_stage(self.rank, chunk, self.p) == 0

    def is_last(self, chunk: int) -> bool:
        return virtual_stage(self.rank, chunk, self.p) == self.p * self.v - 1

    def parameters(self) -> list[nn.Parameter]:
        return [q for c in self.chunks for q in c.parameters()]

    def forward(self, chunk: int, microbatch: int, input: Tensor | None) -> Tensor | None:
        if self.is_first(chunk):
            x = self.first_input(microbatch)
        else:
            x = input.detach().requires_grad_(True)  # a leaf: its .grad is what we send back
        y = self.chunks[chunk](x)
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
        self._weight_grad_todo[chunk, microbatch] = output_grad
        if self.is_first(chunk):
            return None  # no input gradient to produce; all the work happens in backward_weight
        x, y = self._stash[chunk, microbatch]
        (grad,) = torch.autograd.grad(y, x, output_grad, retain_graph=True)
        return grad

    def backward_weight(self, chunk: int, microbatch: int) -> None:
        _, y = self._stash.pop((chunk, microbatch))
        output_grad = self._weight_grad_todo.pop((chunk, microbatch))
        params = [q for q in self.chunks[chunk].parameters() if q.requires_grad]
        if params:
            torch.autograd.backward(y, grad_tensors=output_grad, inputs=params)


class _SavedBytes:
    """Bytes of tensors autograd saves for backward, per (microbatch, chunk), one entry per storage.

    A storage counts in full even when only a view of it is saved (SDPA saves q, k and v as views of the
    fused qkv output): the whole storage stays alive until the backward.

    Parameters (and their views) are excluded: they are resident anyway, only activations count.
    """

    def __init__(self, stage: Any) -> None:
        params = stage.parameters() if hasattr(stage, "parameters") else []
        self._ignore = {q.untyped_storage().data_ptr() for q in params}
        self._live: dict[tuple[int, int], dict[int, int]] = {}
        self.current = self.peak = 0

    def hooks(self, key: tuple[int, int]) -> torch.autograd.graph.saved_tensors_hooks:
        ledger = self._live.setdefault(key, {})

        def pack(t: Tensor) -> Tensor:
            ptr = t.untyped_storage().data_ptr()
            nbytes = t.untyped_storage().nbytes()  # a saved view keeps its whole storage alive
            if ptr not in self._ignore and nbytes > ledger.get(ptr, 0):
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
    recv_lookahead: int = 2,
    recorder: Callable[[str, str, float, float, dict], None] | None = None,
    count_saved_bytes: bool = True,
) -> ScheduleStats:
    """Run one rank's action list. ``comm`` may be None only if the list has no SEND/RECV (p == 1).

    Receives needed by the next ``recv_lookahead`` compute actions are posted before the current compute
    runs; sends go out at the first compute boundary after their action. Tensors between two virtual
    stages on the same rank (p == 1 with v > 1) are handed over locally. ``recorder(name, category, start,
    end, args)``, if given, hears of every compute action and every wait (``ptdp.observability.timeline``).
    ``count_saved_bytes=False`` skips the saved-tensor hooks (``peak_saved_bytes`` is then 0): the
    accounting costs a Python call per saved tensor, and its answer is the same every iteration.
    """
    if comm is None and any(a.op not in COMPUTE_OPS for a in actions):
        raise ValueError("run_schedule: the schedule has SEND/RECV actions but no comm was given")
    stats = ScheduleStats()
    saved = _SavedBytes(stage)
    sent_keys = {message_key(a) for a in actions if a.op.startswith("SEND")}
    compute_at = [i for i, a in enumerate(actions) if a.op in COMPUTE_OPS]
    inbox: dict[tuple[str, int, int], Tensor] = {}  # (kind, microbatch, consumer chunk) -> tensor
    outbox: dict[tuple[str, int, int], Tensor] = {}  # (kind, microbatch, producer chunk) -> tensor
    pending: dict[tuple[str, int, int], PendingRecv] = {}
    live: set[tuple[int, int]] = set()
    send_pos = recv_pos = 0
    start = time.perf_counter()

    def timed(name: str, category: str, t0: float, mb: int | None = None, chunk: int | None = None) -> float:
        """Seconds since ``t0``, told to the recorder as one event."""
        t1 = time.perf_counter()
        if recorder is not None:
            recorder(name, category, t0, t1, {} if mb is None else {"microbatch": mb, "chunk": chunk})
        return t1 - t0

    def take(key: tuple[str, int, int]) -> Tensor | None:
        if key in pending:
            t0 = time.perf_counter()
            tensor = comm.wait(pending.pop(key))
            what = "wait_recv_activation" if key[0] == "F" else "wait_recv_grad"
            stats.idle_s += timed(what, "p2p", t0, key[1], key[2])
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

    for k in range(len(compute_at) + 1):
        idx = compute_at[k] if k < len(compute_at) else len(actions)
        ahead = k + recv_lookahead
        horizon = max(compute_at[ahead] if ahead < len(compute_at) else len(actions), idx)
        sends = [(a, outbox.pop(message_key(a))) for a in actions[send_pos:idx] if a.op.startswith("SEND")]
        recvs = [a for a in actions[recv_pos:horizon] if a.op.startswith("RECV")]
        send_pos, recv_pos = idx + 1, max(recv_pos, horizon)
        if sends or recvs:
            pending.update(comm.issue(sends, recvs))
        if idx == len(actions):
            break
        a = actions[idx]
        mb, c = a.microbatch, a.chunk
        if a.op == "F":
            x = take(("F", mb, c))
            t0 = time.perf_counter()
            with saved.hooks((mb, c)) if count_saved_bytes else contextlib.nullcontext():
                y = stage.forward(c, mb, x)
            stats.busy_s += timed("forward", "compute", t0, mb, c)
            live.add((mb, c))
            stats.peak_in_flight = max(stats.peak_in_flight, len(live))
            deliver("F", mb, c, y)
        elif a.op in ("B", "I"):
            g = take(("B", mb, c))
            t0 = time.perf_counter()
            if a.op == "B":
                dx = stage.backward(c, mb, g)
                saved.free((mb, c))
            else:
                dx = stage.backward_input(c, mb, g)
            stats.busy_s += timed("backward" if a.op == "B" else "backward_input", "compute", t0, mb, c)
            live.discard((mb, c))
            deliver("B", mb, c, dx)
        elif a.op == "W":
            t0 = time.perf_counter()
            stage.backward_weight(c, mb)
            stats.busy_s += timed("backward_weight", "compute", t0, mb, c)
            saved.free((mb, c))

    if comm is not None:
        t0 = time.perf_counter()
        comm.wait_sends()
        stats.idle_s += timed("wait_sends", "p2p", t0)
    if outbox or pending:
        raise RuntimeError(f"run_schedule: unsent {sorted(outbox)} / unconsumed {sorted(pending)} tensors")
    stats.wall_s = time.perf_counter() - start
    stats.peak_saved_bytes = saved.peak
    stats.losses = {mb: float(loss) for mb, loss in sorted(getattr(stage, "losses", {}).items())}
    return stats
