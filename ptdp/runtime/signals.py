"""Signals acted on at once, whatever the main thread is doing.

A Python signal handler runs in the main thread, between two bytecodes: while the main thread sits in a
long C call (a rendezvous waiting for its peers, a gloo collective, ``import torch``, a checkpoint read)
the handler waits with it, which is how a Ctrl-C during start-up used to be lost. Here the C-level handler
only writes the signal's number to a pipe (``signal.set_wakeup_fd``), and a daemon thread reading that
pipe runs the registered callbacks at once; the Python-level handler does nothing.

Callbacks run on that thread, so they may only set flags, write a line, signal other processes or
``os._exit``. :func:`install` is idempotent and must be called from the main thread (Python's rule for
``signal.signal``); :func:`on` may be called from anywhere after it.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

_CALLBACKS: dict[int, Callable[[int], None]] = {}
_INSTALLED: set[int] = set()
_LOCK = threading.Lock()
_THREAD: list[threading.Thread] = []


def _ignore(signum, frame) -> None:
    """The Python-level handler: the thread acts, the main thread goes on (a blocking call is retried)."""


def _reader(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except InterruptedError:
            continue
        except OSError:
            return
        if not data:
            return
        for signum in data:
            with _LOCK:
                callback = _CALLBACKS.get(signum)
            if callback is not None:
                callback(signum)


def install(*signums: int) -> None:
    """Route ``signums`` through the reader thread (main thread only; a second call adds signals).

    The handlers go in before the thread starts: a signal in between waits in the pipe for the thread,
    where, under the default handler, it would raise KeyboardInterrupt in the main thread (starting a
    thread takes seconds on a loaded machine). Register the callback (:func:`on`) first for the same
    reason."""
    with _LOCK:
        thread = None
        if not _THREAD:
            read, write = os.pipe()
            os.set_blocking(write, False)
            signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            thread = threading.Thread(target=_reader, args=(read,), name="ptdp-signals", daemon=True)
            _THREAD.append(thread)
        for signum in signums:
            if signum not in _INSTALLED:
                signal.signal(signum, _ignore)
                _INSTALLED.add(signum)
    if thread is not None:
        thread.start()


def on(signum: int, callback: Callable[[int], None]) -> None:
    """Run ``callback(signum)`` on the reader thread when ``signum`` arrives."""
    with _LOCK:
        _CALLBACKS[signum] = callback


def installed(signum: int) -> bool:
    return signum in _INSTALLED
