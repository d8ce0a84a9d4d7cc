"""What each rank is doing, cheaply: a ring buffer of its last communication operations and counters of
every kind of progress, read by the hang watchdog's thread (``ptdp/observability/watchdog.py``).

Each communication is recorded just before it is issued, by the one door every ptdp call to
``torch.distributed`` goes through (``ptdp/observability/communication.py``)::

    communication.all_reduce(tensor, group=group, action="dp_grads")
    # records ("all_reduce", group, shape and dtype of tensor, "dp_grads"), then calls dist.all_reduce

What is not a call to torch (the pipeline's wait for a posted receive, an evaluation batch) is recorded
with :func:`record` directly.

and report compute as it completes: :func:`tick` once per executor action and per layer (forward and
backward, hooked by ``ptdp/observability/liveness.py``), :func:`progress` at every iteration boundary.
Rank-0-only phases (an index build, a conversion, a checkpoint's commit) :func:`announce` themselves, so
the ranks waiting for them are not counted as hung.

The hot path is a list increment (:func:`tick`: no lock, no clock) or a tuple appended to a deque
(:func:`record`); the watchdog thread turns counter changes into timestamps twice a second. Until a
watchdog enables the recorder (one process, ``--hang-timeout-s 0``), :func:`record` returns at once.
``benchmarks/liveness.py`` measures both (BENCHMARKS.md).
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_OPS: collections.deque = collections.deque(maxlen=64)
# [communication operations, compute ticks, iteration]: plain ints any thread may read; a lost increment
# under a thread switch is harmless (any change is progress).
COUNTS = [0, 0, 0]
COMM, COMPUTE, ITERATION = 0, 1, 2
_ENABLED = [False]
DEVICE: list = [None]  # a liveness.DeviceProgress while a GPU run's watchdog runs
_SOLO: list[str | None] = [None]  # the announced phase this rank is in (see announce)
_NEW_ITERATION = threading.Event()  # wakes the watchdog, so a heartbeat follows each iteration
HANG_EXIT_CODE = 3


def enable(on: bool = True) -> None:
    """Keep records from now on (the watchdog enables the recorder while it runs)."""
    _ENABLED[0] = on


def record(kind: str, group=None, peer: int | list[int] | None = None, tensor=None, action: str | None = None,
           nbytes: int | None = None) -> None:
    """Record a communication operation about to be issued (and the progress it implies). Only the
    tensors' shapes and dtypes are kept (never the tensors); sizes are worked out when read."""
    if not _ENABLED[0]:
        return
    if tensor is None:
        shapes = None
    elif isinstance(tensor, (list, tuple)):
        shapes = [(t.shape, t.dtype) for t in tensor]
    else:
        shapes = (tensor.shape, tensor.dtype)
    COUNTS[COMM] += 1
    _OPS.append((COUNTS[COMM], COUNTS[ITERATION], kind, group, peer, shapes, nbytes, action, time.time()))


def tick() -> None:
    """One unit of compute completed on this rank (a layer's forward or backward, an executor action);
    on a GPU under the watchdog, also an event that says when the device has done it."""
    COUNTS[COMPUTE] += 1
    device = DEVICE[0]
    if device is not None:
        device.mark()


def progress(iteration: int) -> None:
    """The training loop reached ``iteration``."""
    new = COUNTS[ITERATION] != iteration
    COUNTS[ITERATION] = iteration
    if new:
        _NEW_ITERATION.set()


@contextmanager
def announce(what: str) -> Iterator[None]:
    """A phase that keeps this rank busy while others wait for it (rank 0's index build, a checkpoint's
    commit): while it runs, the heartbeat says so and no rank of the job is called hung for its silence.
    A rank that stops or dies inside it still is (its heartbeat stops)."""
    previous, _SOLO[0] = _SOLO[0], what
    COUNTS[COMPUTE] += 1
    try:
        yield
    finally:
        _SOLO[0] = previous
        COUNTS[COMPUTE] += 1


def announced() -> str | None:
    return _SOLO[0]


def _group_ranks(group) -> list[int] | None:
    if group is None:
        return None
    try:
        import torch.distributed as dist

        return dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001 - describing a record must never fail the watchdog
        return None


def _size(shapes) -> tuple[list | None, int | None]:
    """(shape or list of shapes, bytes) of what :func:`record` kept."""
    if shapes is None:
        return None, None
    many = isinstance(shapes, list)
    pairs = shapes if many else [shapes]
    nbytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in pairs)
    listed = [list(shape) for shape, _ in pairs]
    return (listed if many else listed[0]), nbytes


def last_operations(limit: int | None = None) -> list[dict]:
    """The recorded operations, oldest first, as JSON-ready dicts (called by the watchdog thread)."""
    ops = list(_OPS)[-limit:] if limit else list(_OPS)
    out = []
    for seq, it, kind, group, peer, shapes, nbytes, action, t in ops:
        shape, size = _size(shapes)
        out.append({"seq": seq, "iteration": it, "kind": kind, "group": _group_ranks(group), "peer": peer,
                    "shape": shape, "bytes": nbytes if nbytes is not None else size, "action": action, "time": t})
    return out


def describe(op: dict | None) -> str:
    if op is None:
        return "no communication recorded"
    where = f" group {op['group']}" if op["group"] else ""
    peer = f" peer {op['peer']}" if op["peer"] is not None else ""
    action = f" ({op['action']})" if op["action"] else ""
    size = f", {op['bytes']} bytes" if op["bytes"] is not None else ""
    return f"{op['kind']}{where}{peer}{action}{size} at iteration {op['iteration']}"


def run_directory(save: str | None, metrics_file: str | None) -> Path:
    """Where the heartbeats and hang reports go: ``DIR.run`` beside ``--save DIR`` (outside the checkpoint
    directory, on the same storage, which every node of a restartable job shares), else the metrics
    file's folder, else ``./ptdp-run``."""
    if save:
        return Path(save).parent / f"{Path(save).name}.run"
    return Path(os.path.dirname(os.path.abspath(metrics_file or "ptdp-run/x")))
