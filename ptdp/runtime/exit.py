"""Leaving a process that ran torch.distributed without finalising the interpreter.

Two reasons. Tearing torch's modules down takes seconds (8 s on a loaded 2-core machine) for nothing once
every file is closed. And with gloo it can abort the process: a gloo worker thread drops the last collective's
work object (and with it its tensors' Python objects) after ``wait()`` has returned; when that happens after
the interpreter began finalising, the thread cannot take the GIL, exits, and the unwinding through a
destructor calls ``std::terminate`` ("terminate called without an active exception", SIGABRT, even after
``destroy_process_group``: 1 run in 12 of benchmarks/schedules.py on a loaded machine). Spawned workers of the
benchmarks and tests leave through :func:`exit_now` on success (an exception still takes the normal way, so
its traceback reaches the parent).
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def exit_now(code: int = 0) -> NoReturn:
    """Flush stdout and stderr and end the process with ``code`` at once (``os._exit``)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
