"""Where compute progress comes from, besides the executor's per-action :func:`flight_recorder.tick`:

- **Layers** (CPU): a forward hook on each model chunk's modules and on each transformer layer ticks
  when the module's forward returns, and hangs a gradient hook on its output that ticks when the
  backward reaches it, so a rank whose one action takes minutes still ticks once per layer. Not on a GPU,
  where the host only enqueues (and layers may be compiled, hooks and all): there the device reports.
- **The device** (GPU): :class:`DeviceProgress` records a CUDA event after each executor action (a ring
  of 64, reused); the watchdog thread queries them (``cudaEventQuery``: no host synchronisation), so a
  host blocked while its GPU works through a long queue is seen making progress.
- **One long native call** (CPU): :class:`MainThread` samples the main thread's Python frame: one that
  stays on the same call instruction while the process burns CPU is inside one long kernel (a huge GEMM
  under load), not stuck; a Python loop (its instruction moves, or is no call) and a blocking wait (no
  CPU) are not progress.
"""

from __future__ import annotations

import dis
import sys
import threading
import time
from collections.abc import Callable, Sequence

from ptdp.observability.flight_recorder import COMPUTE, COUNTS

# --- layers --------------------------------------------------------------------------------------------


def _grad_tick(grad):
    COUNTS[COMPUTE] += 1


def _forward_tick(module, args, output) -> None:
    COUNTS[COMPUTE] += 1
    out = output[0] if isinstance(output, tuple) and output else output
    if getattr(out, "requires_grad", False):
        out.register_hook(_grad_tick)


def watch_layers(chunks: Sequence) -> list:
    """Hook every model chunk, its children and each child of a layer container (``layers``); returns the
    hook handles (``handle.remove()`` undoes it)."""
    from torch import nn

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
            import torch

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

_CALLS = {dis.opmap[name] for name in ("CALL", "CALL_FUNCTION_EX", "PRECALL", "BINARY_OP", "BINARY_SUBSCR",
                                       "STORE_SUBSCR", "COMPARE_OP", "CALL_INTRINSIC_1", "CALL_INTRINSIC_2",
                                       "CALL_KW") if name in dis.opmap}
_COMM_FILES = ("torch/distributed/", "ptdp/parallel/pipeline/p2p.py")
_WAITS = {"wait", "wait_for", "wait_sends", "barrier", "monitored_barrier"}


class MainThread:
    """Samples of the main thread: where it is, whether it waits in communication, and whether it sits
    inside one native call while the process uses the CPU (see the module docstring)."""

    def __init__(self) -> None:
        self.ident = threading.main_thread().ident
        self._last: tuple | None = None
        self._cpu, self._wall = time.process_time(), time.monotonic()

    def _frame(self):
        return sys._current_frames().get(self.ident)

    def _signature(self) -> tuple | None:
        frame = self._frame()
        if frame is None:
            return None
        lasti = frame.f_lasti
        code = frame.f_code.co_code
        return id(frame), lasti, lasti >= 0 and lasti < len(code) and code[lasti] in _CALLS

    def busy_in_one_call(self) -> bool:
        """Whether, since the last sample, the main thread stayed in one native call and the process used
        at least half a core (three quick looks, so a Python loop passing a call is not mistaken)."""
        cpu, wall = time.process_time(), time.monotonic()
        burning = (cpu - self._cpu) >= 0.5 * (wall - self._wall)
        self._cpu, self._wall = cpu, wall
        looks = []
        for _ in range(3):
            looks.append(self._signature())
            time.sleep(0.001)
        same = looks[0] is not None and looks.count(looks[0]) == 3 and looks[0][2]
        stayed = same and self._last == looks[0]
        self._last = looks[0] if same else None
        return bool(burning and stayed)

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

