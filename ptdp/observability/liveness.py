"""Where compute progress comes from, besides the executor's per-action :func:`flight_recorder.tick`:

- **Layers** (CPU): a forward hook on each model chunk's modules and on each transformer layer ticks
  when the module's forward returns, and hangs a gradient hook on its output that ticks when the
  backward reaches it, so a rank whose one action takes minutes still ticks once per layer. Not on a GPU,
  where the host only enqueues (and layers may be compiled, hooks and all): there the device reports.
- **The device** (GPU): :class:`DeviceProgress` records a CUDA event after each executor action (a ring
  of 64, reused); the watchdog thread queries them (``cudaEventQuery``: no host synchronisation), so a
  host blocked while its GPU works through a long queue is seen making progress.

:class:`MainThread` tells the hang report where a silent rank's main thread is, and whether it waits
(blocked: no CPU, or in a communication call: a peer's fault), computes (inside one long native operation,
a matmul of minutes on a loaded CPU: the interpreter lock is free and the process's CPU time advances)
or loops in Python (its own code holds the interpreter lock).
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ptdp.observability.flight_recorder import COMPUTE, COUNTS

# --- layers --------------------------------------------------------------------------------------------


def _grad_tick(grad):
    COUNTS[COMPUTE] += 1


def _forward_tick(module, args, output) -> None:
    COUNTS[COMPUTE] += 1
    out = output[0] if isinstance(output, tuple) and output else output
    if isinstance(out, torch.Tensor) and out.requires_grad:
        out.register_hook(_grad_tick)


def watch_layers(chunks: Sequence) -> list:
    """Hook every model chunk, its children and each child of a layer container (``layers``); returns the
    hook handles (``handle.remove()`` undoes it)."""
    handles = []
    for chunk in chunks:
        modules = [chunk]
        for child in chunk.children():
            modules.extend(child.children() if isinstance(child, nn.ModuleDict | nn.ModuleList) else [child])
        handles.extend(m.register_forward_hook(_forward_tick) for m in modules)
    return handles


# --- the device ----------------------------------------------------------------------------------------


class DeviceProgress:
    """Executor actions completed on the GPU, counted from the watchdog thread without a host sync.

    :meth:`mark` (the main thread, after each action: ``flight_recorder.tick``) records the next event of
    a ring; :meth:`completed` (the watchdog) queries the events past the last one known complete. An event
    re-recorded for a later action only answers later, never earlier, so the count never runs ahead."""

    def __init__(self, size: int = 64, make_event: Callable | None = None) -> None:
        if make_event is None:
            make_event = torch.cuda.Event
        self.size = size
        self._events = [make_event() for _ in range(size)]
        self.recorded = 0
        self.done = 0

    def mark(self) -> None:
        self._events[self.recorded % self.size].record()
        self.recorded += 1

    def completed(self) -> int:
        recorded, done = self.recorded, self.done
        if recorded - done > self.size:  # the oldest events were recorded again: start from the oldest kept
            if not self._events[(recorded - self.size) % self.size].query():
                return done
            done = recorded - self.size + 1
        while done < recorded and self._events[done % self.size].query():
            done += 1
        self.done = done
        return done


# --- the main thread -----------------------------------------------------------------------------------

# a frame in one of these files is inside a communication call (the door of every ptdp collective, the
# pipeline's transport, which waits for its receives)
_COMM_FILES = ("torch/distributed/", "ptdp/observability/communication.py", "ptdp/parallel/pipeline/p2p.py")
_WAITS = {"wait", "wait_for", "wait_sends", "barrier", "monitored_barrier"}


_TAKES_KEPT = 56  # the interpreter lock takes :meth:`MainThread.native_share` judges by: 8 heartbeats' worth


class _CpuRate:
    """The share of one core a CPU clock advanced over about the last ``window_s`` seconds of samples."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._samples: collections.deque = collections.deque([(time.monotonic(), clock())])

    def share(self, window_s: float = 2.0) -> float:
        now, cpu = time.monotonic(), self.clock()
        self._samples.append((now, cpu))
        while len(self._samples) > 2 and now - self._samples[1][0] >= window_s:
            self._samples.popleft()
        then, cpu_then = self._samples[0]
        return (cpu - cpu_then) / max(now - then, 1e-6)


class MainThread:
    """Where the main thread is, whether it waits or computes (read by the watchdog thread)."""

    def __init__(self) -> None:
        self.ident = threading.main_thread().ident
        try:  # the main thread's own CPU clock: the watchdog's and gloo's threads do not count
            clock: int | None = time.pthread_getcpuclockid(self.ident)
        except (AttributeError, OSError):
            clock = None
        self._thread = _CpuRate(time.process_time if clock is None else lambda: time.clock_gettime(clock))
        # The process's CPU time (utime + stime of every thread, /proc/<pid>/stat's): an operation may run
        # on intra-op threads while the main thread waits for them.
        self._process = _CpuRate(time.process_time)
        self._takes: collections.deque = collections.deque(maxlen=_TAKES_KEPT)

    def cpu_share(self, window_s: float = 2.0) -> float:
        """The share of one core the main thread used over about the last ``window_s`` seconds: about 0
        while it is blocked (a collective, a receive, a lock), more while it runs (a loop gets some CPU even
        on a machine loaded many times over, over a window of seconds)."""
        return self._thread.share(window_s)

    def process_cpu_share(self, window_s: float = 2.0) -> float:
        """The share of one core the whole process used over about the last ``window_s`` seconds."""
        return self._process.share(window_s)

    def native_share(self, trials: int = 7) -> float:
        """How often the main thread was found inside a native call that let go of the interpreter lock (a
        torch operation, a hash, a blocking wait) rather than running Python bytecode: the share of the takes
        of the lock since :meth:`forget_native` (the last ``_TAKES_KEPT``) that found it free at once.

        Called from another thread (the watchdog's), which gives up the lock and takes it back ``trials``
        times now. A main thread running Python holds the lock and hands it over only when the interpreter
        forces a switch, after ``sys.getswitchinterval()`` (5 ms): most takes wait that long. Inside a
        native call the lock is free and a take returns in microseconds. A take is a noisy witness on a
        loaded machine (a main thread slow to wake lets the lock go by), hence a share over many: about 1
        inside operations, well under 1/2 in a Python loop, measured at a load of 7 per core."""
        limit = sys.getswitchinterval() / 2
        for _ in range(trials):
            start = time.perf_counter()
            time.sleep(0)  # releases the interpreter lock and takes it back
            self._takes.append(time.perf_counter() - start < limit)
        return sum(self._takes) / len(self._takes)

    def forget_native(self) -> None:
        """Start :meth:`native_share` afresh (the rank made progress: its next silence is another one)."""
        self._takes.clear()

    def _frame(self):
        return sys._current_frames().get(self.ident)

    def where(self) -> tuple[str, bool]:
        """("file:line in function" of the innermost frame outside torch, whether it waits in communication)."""
        frame = self._frame()
        place, comm, depth = "unknown", False, 0
        while frame is not None and depth < 40:
            name = frame.f_code.co_filename.replace("\\", "/")
            if frame.f_code.co_name in _WAITS or any(part in name for part in _COMM_FILES):
                comm = True
            if place == "unknown" and "/torch/" not in name:
                place = f"{_short(name)}:{frame.f_lineno} in {frame.f_code.co_name}"
            frame, depth = frame.f_back, depth + 1
        return place, comm


def _short(path: str) -> str:
    for marker in ("/ptdp/", "/tests/"):
        if marker in path:
            return path[path.rindex(marker) + 1:]
    return path.rsplit("/", 1)[-1]

