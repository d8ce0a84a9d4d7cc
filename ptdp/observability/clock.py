"""Timestamps of GPU work that the host can take without waiting for the GPU.

On a CUDA device the host only *launches* kernels and runs ahead of them, so ``perf_counter`` around a
step times the launches, not the work. Megatron's timers record CUDA events instead and read them once
the GPU has caught up; so does :class:`Clock`: ``mark()`` is a recorded ``torch.cuda.Event`` on CUDA (no
sync) and ``perf_counter()`` elsewhere, and :func:`seconds` turns two marks into seconds, after something
else (the iteration's one read of its loss) has waited for the GPU.
"""

from __future__ import annotations

import time
from typing import Any

Mark = Any  # float seconds (CPU) or torch.cuda.Event (CUDA)


class Clock:
    """``mark()`` now, in the device's own time line (see the module docstring)."""

    def __init__(self, device: Any = "cpu"):
        import torch

        self.cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()

    def mark(self) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Mark, end: Mark) -> float:
        """Seconds from ``start`` to ``end``; CUDA events must have completed (waits for ``end`` if not)."""
        return seconds(start, end)


def seconds(start: Mark, end: Mark) -> float:
    """Seconds between two marks of the same kind (floats, or CUDA events that ``end`` waits for)."""
    if isinstance(start, int | float):
        return float(end - start)
    if not end.query():
        end.synchronize()  # only outside the steady state: callers read marks after the iteration's sync
    return start.elapsed_time(end) / 1000.0
