"""The one loop over a pipeline schedule: ``run_schedule(actions, stage, comm, handlers)``.

Schedules are data (``ptdp.schedule``); this module runs any such list on a ``PipelineStage`` (what to
compute) and a ``P2PComm`` (how tensors travel). It knows compute and communication only:

* F, B, I, W go to the stage (``forward``, ``backward``, ``backward_input``, ``backward_weight``);
* each run of consecutive SEND/RECV actions is ONE batched p2p call, issued where it stands, and a
  received tensor is waited on only by the compute that consumes it. The lists are placed so that this
  cannot hang under NCCL's ordering (``ptdp.schedule.communication.place_communication``, checked by
  ``ptdp.simulate.nccl.model``), and transfers overlap the computes between a message's post and its
  consumer;
* every other op is run by the handler registered for it (``ptdp.parallel.pipeline.handlers``): the stage's
  own (``stage.handlers()``, for the actions a stage plug-in adds) and those passed in (the other
  plug-ins', from ``ptdp.parallel.assembly``). An op with no handler is an error before anything runs.
  The executor names no parallelism: ``ptdp.parallel.pipeline.handlers`` says how one plugs in.

``ptdp.parallel.pipeline.module_stage.ModuleStage`` is the autograd implementation of a stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn

from ptdp.observability import flight_recorder
from ptdp.observability.clock import Clock, Mark, seconds
from ptdp.parallel.pipeline.handlers import COMMUNICATION, COMPUTE, ActionHandler, merge_handlers
from ptdp.parallel.pipeline.p2p import P2PComm, PendingRecv, message_key
from ptdp.schedule.actions import COMM_OPS, COMPUTE_OPS, Action

Recorder = Callable[[str, str, Mark, Mark, dict], None]


class PipelineStage(Protocol):
    """What one pipeline rank computes; chunk is the LOCAL chunk index (``ptdp.schedule.actions.virtual_stage``)."""

    losses: dict[int, Tensor]  # per microbatch, on the last virtual stage: detached device tensors

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (the executor leaves them out of the saved-activation bytes)."""
        ...

    def handlers(self) -> Mapping[str, ActionHandler]:
        """The ops beyond F/B/I/W this stage runs (a stage plug-in's passes); empty for a plain stage."""
        ...

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

    def forward_backward(self, forward: Action, input: Tensor | None, backward: Action, output_grad: Tensor | None,
                         saving: Callable[[], contextlib.AbstractContextManager]) -> tuple[Tensor | None, Tensor | None]:
        """An overlapped pair (``ptdp.parallel.pipeline.overlap``): ``forward`` (an F) and ``backward`` (a B or
        I of another microbatch) at once; ``saving()`` wraps what the forward saves for its backward.
        Returns (the activation to send, the input gradient), as ``forward`` and ``backward`` do."""
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


class _SavedBytes:
    """Bytes of tensors autograd saves for backward, per (microbatch, chunk), one entry per storage.

    A storage counts in full even when only a view of it is saved (SDPA saves q, k and v as views of the
    fused qkv output): the whole storage stays alive until the backward.

    Parameters (and their views) are excluded: they are resident anyway, only activations count. So are
    tensors saved in host memory by a GPU stage (``--checkpoint-in-cpu``): they hold no device memory.
    """

    def __init__(self, stage: PipelineStage) -> None:
        params = stage.parameters()
        self._on_host = not params or params[0].device.type == "cpu"
        # By storage identity, not address: parameter sharding frees and re-allocates a parameter's storage.
        self._ignore = {q.untyped_storage()._cdata for q in params}
        self._live: dict[tuple[int, int], dict[int, int]] = {}
        self.current = self.peak = 0

    def hooks(self, key: tuple[int, int]) -> torch.autograd.graph.saved_tensors_hooks:
        ledger = self._live.setdefault(key, {})

        def pack(t: Tensor) -> Tensor:
            ptr = t.untyped_storage().data_ptr()
            nbytes = t.untyped_storage().nbytes()  # a saved view keeps its whole storage alive
            if t.device.type == "cpu" and not self._on_host:
                return t
            if t.untyped_storage()._cdata not in self._ignore and nbytes > ledger.get(ptr, 0):
                self.current += nbytes - ledger.get(ptr, 0)
                ledger[ptr] = nbytes
                self.peak = max(self.peak, self.current)
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def free(self, key: tuple[int, int]) -> None:
        self.current -= sum(self._live.pop(key, {}).values())


class _Run:
    """One run of a list: the tensors between stages, the spans, the activations in flight. Handlers see
    it as their ``ScheduleContext``."""

    def __init__(self, actions: Sequence[Action], stage: PipelineStage, comm: P2PComm | None,
                 recorder: Recorder | None, count_saved_bytes: bool, device: torch.device | str | None) -> None:
        self.stage, self.comm, self.recorder = stage, comm, recorder
        if device is None:  # walking the stage's parameters costs a Python call per module: callers pass it
            params = stage.parameters()
            device = params[0].device if params else "cpu"
        self.clock = Clock(device)
        self.stats = ScheduleStats()
        self.spans = self.stats._spans = [("schedule", self.clock.mark(), None)]
        self.saved = _SavedBytes(stage) if count_saved_bytes else None
        self.sent_keys = {message_key(a) for a in actions if a.op.startswith("SEND")}
        self.inbox: dict[tuple[str, int, int], Tensor] = {}  # (kind, microbatch, consumer chunk) -> tensor
        self.outbox: dict[tuple[str, int, int], Tensor] = {}  # (kind, microbatch, producer chunk) -> tensor
        self.pending: dict[tuple[str, int, int], PendingRecv] = {}
        self.live: set[tuple[int, int]] = set()
        if comm is not None:
            comm.expect(actions)

    def span(self, name: str, category: str, start: Mark, mb: int | None = None, chunk: int | None = None) -> None:
        end = self.clock.mark()
        self.spans.append((category, start, end))
        if self.recorder is not None:
            self.recorder(name, category, start, end, {} if mb is None else {"microbatch": mb, "chunk": chunk})

    def receive(self, kind: str, microbatch: int, chunk: int) -> Tensor | None:
        key = (kind, microbatch, chunk)
        if key in self.pending:
            t0 = self.clock.mark()
            tensor = self.comm.wait(self.pending.pop(key))
            self.span("wait_recv_activation" if kind == "F" else "wait_recv_grad", COMMUNICATION, t0,
                      microbatch, chunk)
            return tensor
        return self.inbox.pop(key, None)

    def deliver(self, kind: str, microbatch: int, chunk: int, tensor: Tensor | None) -> None:
        if tensor is None:
            return
        if (kind, microbatch, chunk) in self.sent_keys:
            self.outbox[kind, microbatch, chunk] = tensor.detach()
        else:  # next virtual stage lives on this rank
            consumer = chunk + 1 if kind == "F" else chunk - 1
            if consumer >= 0:  # a stage-0 input grad has no consumer
                self.inbox[kind, microbatch, consumer] = tensor

    def communicate(self, batch: Sequence[Action]) -> None:
        """One batched p2p call for a run of SEND/RECV actions."""
        sends = [(s, self.outbox.pop(message_key(s))) for s in batch if s.op.startswith("SEND")]
        self.pending.update(self.comm.issue(sends, [r for r in batch if r.op.startswith("RECV")]))

    def saving(self, mb: int, chunk: int) -> contextlib.AbstractContextManager:
        return self.saved.hooks((mb, chunk)) if self.saved is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def timed(self, name: str, mb: int, chunk: int) -> Iterator[None]:
        t0 = self.clock.mark()
        yield
        self.span(name, COMPUTE, t0, mb, chunk)

    def computed(self, a: Action) -> None:
        """The accounting of an F, B, I or W that ran: activations in flight and saved."""
        key = (a.microbatch, a.chunk)
        if a.op == "F":
            self.live.add(key)
            self.stats.peak_in_flight = max(self.stats.peak_in_flight, len(self.live))
            return
        if a.op in ("B", "I"):
            self.live.discard(key)
        if a.op in ("B", "W") and self.saved is not None:
            self.saved.free(key)

    def compute(self, a: Action) -> None:
        """F, B, I or W through the stage."""
        mb, c, stage = a.microbatch, a.chunk, self.stage
        if a.op == "F":
            x = self.receive("F", mb, c)
            with self.timed("forward", mb, c), self.saving(mb, c):
                y = stage.forward(c, mb, x)
            self.computed(a)
            self.deliver("F", mb, c, y)
        elif a.op in ("B", "I"):
            g = self.receive("B", mb, c)
            with self.timed("backward" if a.op == "B" else "backward_input", mb, c):
                dx = stage.backward(c, mb, g) if a.op == "B" else stage.backward_input(c, mb, g)
            self.computed(a)
            self.deliver("B", mb, c, dx)
        else:
            with self.timed("backward_weight", mb, c):
                stage.backward_weight(c, mb)
            self.computed(a)

    def finish(self) -> ScheduleStats:
        if self.comm is not None:
            t0 = self.clock.mark()
            self.comm.wait_sends()
            self.span("wait_sends", COMMUNICATION, t0)
        if self.outbox or self.pending:
            raise RuntimeError(f"run_schedule: unsent {sorted(self.outbox)} / unconsumed {sorted(self.pending)} "
                               "tensors")
        self.spans[0] = ("schedule", self.spans[0][1], self.clock.mark())
        self.stats.peak_saved_bytes = self.saved.peak if self.saved is not None else 0
        self.stats.losses = dict(sorted(self.stage.losses.items()))
        return self.stats


def _comm_runs(actions: Sequence[Action]) -> Iterator[tuple[int, int]]:
    """(start, end) of each maximal run of consecutive SEND/RECV actions."""
    i = 0
    while i < len(actions):
        if actions[i].op in COMM_OPS:
            j = i
            while j < len(actions) and actions[j].op in COMM_OPS:
                j += 1
            yield i, j
            i = j
        else:
            i += 1


def run_schedule(
    actions: Sequence[Action],
    stage: PipelineStage,
    comm: P2PComm | None = None,
    handlers: Mapping[str, ActionHandler] | None = None,
    recorder: Recorder | None = None,
    count_saved_bytes: bool = True,
    device: torch.device | str | None = None,
) -> ScheduleStats:
    """Run one rank's action list. ``comm`` may be None only if the list has no SEND/RECV (p == 1).

    Each run of consecutive SEND/RECV actions goes out as one batched call where it stands in the list;
    a receive is waited on right before the compute that consumes it; sends are waited on at the end.
    Tensors between two virtual stages on the same rank (no SEND/RECV between them) are handed over
    locally. Any other op runs through ``stage.handlers()`` or ``handlers`` (each op registered once).
    ``recorder(name, category, start, end, args)``, if given, hears of every compute action, every wait
    and every timed handler (``ptdp.observability.timeline``), with ``Clock`` marks.
    ``count_saved_bytes=False`` skips the saved-tensor hooks (``peak_saved_bytes`` is then 0): the
    accounting costs a Python call per saved tensor, and its answer is the same every iteration.
    ``device``: where the stage computes (what its clock marks); None reads it off ``stage.parameters()``.
    """
    if comm is None and any(a.op in COMM_OPS for a in actions):
        raise ValueError("run_schedule: the schedule has SEND/RECV actions but no comm was given")
    table = merge_handlers(stage.handlers(), handlers or {})
    unknown = sorted({a.op for a in actions} - COMPUTE_OPS - COMM_OPS - table.keys())
    if unknown:
        raise ValueError(f"run_schedule: no handler registered for the action op(s) {unknown} "
                         f"(registered: {sorted(table) or 'none'})")
    run = _Run(actions, stage, comm, recorder, count_saved_bytes, device)
    batches = dict(_comm_runs(actions))
    i = 0
    while i < len(actions):
        flight_recorder.tick()  # liveness: the previous action is done (ptdp/observability/watchdog.py)
        a = actions[i]
        if i in batches:
            run.communicate(actions[i:batches[i]])
            i = batches[i]
            continue
        if a.op in COMPUTE_OPS:
            run.compute(a)
        else:
            handler = table[a.op]
            t0 = run.clock.mark()
            handler(a, run)
            if handler.span is not None:
                run.span(handler.span, handler.category, t0, a.microbatch, a.chunk)
        i += 1
    return run.finish()
