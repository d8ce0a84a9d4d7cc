"""Say so on rank 0 when a start-up step takes more than a couple of seconds.

Between ``ptdp train`` and its first progress line lie steps that can take tens of seconds (tokenizing
and caching the corpus, building and initialising the model, the first iteration with its one-off
costs); a silent terminal looks hung. :func:`phase` prints `` <step>...`` once the step has run for
``after_s`` seconds, and `` <step>: done in X s`` when it ends, on rank 0 only. Steps that finish sooner
print nothing, so short runs and the tests' output stay as they were.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ptdp.runtime.errors import write_line

AFTER_S = 2.0


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class Phase:
    """One announced step (see :func:`phase`); ``stop`` ends it."""

    def __init__(self, what: str, after_s: float = AFTER_S, rank: int | None = None):
        self.what, self.start = what, time.perf_counter()
        self.announced = False
        self._lock = threading.Lock()
        self._timer = None
        if (_rank() if rank is None else rank) == 0:
            self._timer = threading.Timer(after_s, self._announce)
            self._timer.daemon = True
            self._timer.start()

    def _announce(self) -> None:
        with self._lock:
            if self._timer is not None:
                self.announced = True
                _say(f" {self.what}...")

    def stop(self) -> None:
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is None:  # stopped before (or never started: not rank 0)
            return
        timer.cancel()
        if self.announced:
            _say(f" {self.what}: done in {time.perf_counter() - self.start:.1f} s")


@contextmanager
def phase(what: str, after_s: float = AFTER_S, rank: int | None = None) -> Iterator[Phase]:
    """Announce ``what`` on rank 0 if it is still running after ``after_s`` seconds."""
    step = Phase(what, after_s, rank)
    try:
        yield step
    finally:
        step.stop()


def _say(line: str) -> None:
    write_line(sys.stdout, line)
