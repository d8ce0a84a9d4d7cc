"""Say so on rank 0 when a start-up step takes more than a couple of seconds, and keep saying it.

Between ``ptdp train`` and its first progress line lie steps that can take tens of seconds (importing
torch, the rendezvous, tokenizing and caching the corpus, building and initialising the model, loading a
checkpoint, the first iteration with its one-off costs); a silent terminal looks hung. :func:`phase`
prints `` <step>...`` once the step has run for ``after_s`` seconds, `` <step>... (still, N s)`` every
:data:`REPEAT_S` seconds after that, and `` <step>: done in X s`` when it ends, on rank 0 only. Steps that
finish sooner print nothing, so short runs and the tests' output stay as they were.
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
REPEAT_S = 10.0
_RUNNING: list[Phase] = []  # the steps under way, innermost last (what a Ctrl-C's line names)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class Phase:
    """One announced step (see :func:`phase`); ``stop`` ends it."""

    def __init__(self, what: str, after_s: float = AFTER_S, rank: int | None = None):
        self.what, self.start = what, time.perf_counter()
        self.announced = False
        self._lock = threading.Lock()
        self._timer = None
        _RUNNING.append(self)
        if (_rank() if rank is None else rank) == 0:
            self._timer = threading.Timer(after_s, self._announce)
            self._timer.daemon = True
            self._timer.start()

    def _announce(self) -> None:
        with self._lock:
            if self._timer is None:
                return
            elapsed = time.perf_counter() - self.start
            _say(f" {self.what}... (still, {elapsed:.0f} s)" if self.announced else f" {self.what}...")
            self.announced = True
            self._timer = threading.Timer(REPEAT_S, self._announce)
            self._timer.daemon = True
            self._timer.start()

    def stop(self) -> None:
        if self in _RUNNING:
            _RUNNING.remove(self)
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is None:  # stopped before (or never started: not rank 0)
            return
        timer.cancel()
        if self.announced:
            _say(f" {self.what}: done in {time.perf_counter() - self.start:.1f} s")


def current() -> str | None:
    """The innermost step under way on this process (None: none)."""
    running = list(_RUNNING)
    return running[-1].what if running else None


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
