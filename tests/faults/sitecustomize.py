"""Fault and bug injection for tests, from outside the production modules.

Python imports ``sitecustomize`` at start-up from the first directory on ``sys.path`` that has one, so a
test puts this directory on ``PYTHONPATH`` (``helpers.worker_env`` does, for every ``ptdp`` process it
starts) and sets one of the ``PTDP_TEST_*`` variables below; each process of the run (the launcher, the
torchrun agent and every worker) then wraps the named functions before ``ptdp`` runs. Without a
``PTDP_TEST_*`` variable this file imports nothing and patches nothing.

Every target is one line of ``PATCHES`` (``"module.path:Attribute.path"``): when the code moves, this
table is the one place to update.

- ``PTDP_TEST_SLOW_RANK=R:SECONDS``: rank R (``*``: every rank) sleeps SECONDS before the first microbatch
  of each training step (inside the schedule's compute time) and before each validation batch.
- ``PTDP_TEST_SLOW_LAYER=R:SECONDS``: rank R (``*``: every rank) sleeps SECONDS inside the forward of
  each transformer layer (slow compute, on purpose: a rank that computes, however slowly, is no hang).
- ``PTDP_TEST_KILL_AT_ITERATION=N[:SIGNAL]``: one rank (``PTDP_TEST_KILL_RANK``, default the last) sends
  itself SIGKILL (or SIGTERM, SIGSTOP, ...) at the start of iteration N, once per run directory (a
  ``.test-killed-<run dir>-N`` marker beside it keeps a restarted run from dying again). With
  ``PTDP_TEST_KILL_REPLICA_GROUP=G`` only in replica group G (``--fault-tolerant-replicas``).
- ``PTDP_TEST_LOOP_AT_ITERATION=N``: that rank loops in Python without progress at the start of iteration N
  (once per run directory, as above).
- ``PTDP_TEST_COMPUTE_AT_ITERATION=N:SECONDS``: one rank (``PTDP_TEST_KILL_RANK``, default 0) computes for
  SECONDS at the start of iteration N (matmuls, nothing that ticks: live work that reports no progress), once
  per run directory (as above).
- ``PTDP_TEST_CRASH_IN_SAVE=N``: every rank exits 17 once the data files of iteration N are written, before
  the commit. ``N:POINT`` instead SIGKILLs one rank (``PTDP_TEST_KILL_RANK``, default the last; rank 0 for
  ``before-latest``, which only rank 0 reaches) once per save directory (``.test-crashed-N-POINT``):
  ``written`` after its data files are written (its own file truncated first, as a write cut short leaves
  it), ``hashed`` after the files are fsynced and hashed, ``before-latest`` after the rename into place but
  before ``latest`` moves. Several comma-separated entries (``4:hashed,6:before-latest``) crash one job
  at each in turn (with ``--max-restarts`` enough for all).
- ``PTDP_TEST_SLOW_SAVE=N:SECONDS``: every rank sleeps SECONDS once the data files of a checkpoint of
  iteration N or later are written, before the commit: a save a test can signal while it is under way,
  however fast the machine writes.
- ``PTDP_TEST_WORKER_MARKER=DIR``: every worker process (``LOCAL_RANK`` set) touches ``DIR/worker-<rank>``
  as it starts, so a test can tell that a launcher refused before any worker existed.
- ``PTDP_TEST_SLOW_WORKER_START=SECONDS``: every worker process sleeps SECONDS right after that marker,
  still inside Python's own start-up (``site``), before any ptdp code: a moment a test can signal.
- ``PTDP_TEST_BUG=dp-sum|tp-grad``: a deliberate scaling bug, so tests can show the equivalence helpers
  catch it: ``dp-sum`` sums the data-parallel gradients instead of averaging them (a wrong 1/d factor);
  ``tp-grad`` drops the all-reduce of the input gradient in the backward of the tensor-parallel ``f``
  operator (a gradient missing its tensor-parallel reduction).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import signal
import time
from pathlib import Path


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _victim(default: int) -> int:
    return int(os.environ.get("PTDP_TEST_KILL_RANK", default))


def _once(marker: Path) -> bool:
    """True the first time for this marker file (it survives a restart, so a restarted run passes)."""
    if marker.exists():
        return False
    marker.touch()
    return True


# -- PTDP_TEST_SLOW_RANK ---------------------------------------------------------------------------------

def _delay(variable: str = "PTDP_TEST_SLOW_RANK") -> None:
    who, _, seconds = os.environ[variable].partition(":")
    if who == "*" or int(who) == _rank():
        time.sleep(float(seconds))


def slow_microbatch(original, *args, **kwargs):
    if args[-1] == 0:  # get_microbatch(dataset, k, B, dp_rank, dp, b, j): once per (training or validation) batch k
        _delay()
    return original(*args, **kwargs)


# -- PTDP_TEST_KILL_AT_ITERATION -------------------------------------------------------------------------

def slow_layer(original, layer, *args, **kwargs):
    _delay("PTDP_TEST_SLOW_LAYER")
    return original(layer, *args, **kwargs)


def _marker(controller, what: str, iteration: int) -> Path:
    run_dir = Path(controller.run_dir)
    return run_dir.parent / f".test-{what}-{run_dir.name}-{iteration}"


def kill_at_iteration(original, controller, iteration, *args, **kwargs):
    result = original(controller, iteration, *args, **kwargs)
    at, _, name = os.environ["PTDP_TEST_KILL_AT_ITERATION"].partition(":")
    group = os.environ.get("PTDP_TEST_KILL_REPLICA_GROUP")
    if group is not None and group != os.environ.get("PTDP_REPLICA_GROUP"):
        return result
    if int(at) == iteration and _rank() == _victim(_world_size() - 1):
        if _once(_marker(controller, "killed", iteration)):
            os.kill(os.getpid(), getattr(signal, f"SIG{name or 'KILL'}"))
    return result


def loop_at_iteration(original, controller, iteration, *args, **kwargs):
    result = original(controller, iteration, *args, **kwargs)
    if int(os.environ["PTDP_TEST_LOOP_AT_ITERATION"]) == iteration and _rank() == _victim(_world_size() - 1):
        if _once(_marker(controller, "looped", iteration)):
            while True:  # no layer, no action, no communication: a rank stuck in its own Python code
                pass
    return result


def compute_at_iteration(original, controller, iteration, *args, **kwargs):
    result = original(controller, iteration, *args, **kwargs)
    at, _, seconds = os.environ["PTDP_TEST_COMPUTE_AT_ITERATION"].partition(":")
    if int(at) == iteration and _rank() == _victim(0) and _once(_marker(controller, "computed", iteration)):
        import torch

        a, end = torch.randn(512, 512), time.monotonic() + float(seconds)
        while time.monotonic() < end:  # the interpreter lock is free inside each matmul
            a = torch.tanh(a @ a)
    return result


# -- PTDP_TEST_CRASH_IN_SAVE -----------------------------------------------------------------------------

def _crash_points() -> list[tuple[int, str]]:
    """``N[:POINT]`` entries of ``PTDP_TEST_CRASH_IN_SAVE``, comma-separated: one job, several crashes."""
    return [(int(at), which) for at, _, which in
            (entry.partition(":") for entry in os.environ["PTDP_TEST_CRASH_IN_SAVE"].split(","))]


def _crash_in_save(iteration: int, point: str, tmp: Path, rank: int) -> None:
    for at, which in _crash_points():
        if at != iteration:
            continue
        if not which:
            if point == "written":
                os._exit(17)
            continue
        victim = 0 if which == "before-latest" else _victim(_world_size() - 1)
        if which != point or rank != victim or not _once(tmp.parent / f".test-crashed-{iteration}-{which}"):
            continue
        if point == "written":
            for own in tmp.glob(f"__{rank}_*.distcp"):
                os.truncate(own, own.stat().st_size // 2)
        os.kill(os.getpid(), signal.SIGKILL)


def _iteration_of(tmp: Path | None) -> int | None:
    """The iteration of a checkpoint's temporary directory (``.tmp-iter_NNNNNNN``), else None."""
    name = Path(tmp).name if tmp is not None else ""
    return int(name.rpartition("_")[2]) if name.startswith(".tmp-iter_") else None


def crash_after_data_files(original, *args, **kwargs):
    """Wraps the DCP save of a checkpoint's data files (into its temporary directory)."""
    result = original(*args, **kwargs)
    tmp = kwargs.get("checkpoint_id")
    if (iteration := _iteration_of(tmp)) is not None:
        _crash_in_save(iteration, "written", Path(tmp), _rank())
    return result


def crash_after_hashing(original, directory, *args, **kwargs):
    result = original(directory, *args, **kwargs)
    if (iteration := _iteration_of(Path(directory))) is not None:
        _crash_in_save(iteration, "hashed", Path(directory), _rank())
    return result


def crash_before_latest(original, path, *args, **kwargs):
    """Wraps the fsync of the checkpoint root after the rename into place: the first one for an iteration
    whose directory exists while ``latest`` does not name it yet is the moment before ``latest`` moves."""
    result = original(path, *args, **kwargs)
    root = Path(path)
    latest = root / "latest"
    for at, which in _crash_points():
        if which == "before-latest" and (root / f"iter_{at:07d}").is_dir() and not (
                latest.exists() and latest.read_text().strip() == str(at)):
            _crash_in_save(at, "before-latest", root / f".tmp-iter_{at:07d}", _rank())
    return result


def slow_after_data_files(original, *args, **kwargs):
    """Wraps the DCP save of a checkpoint's data files, as ``crash_after_data_files`` does."""
    result = original(*args, **kwargs)
    at, _, seconds = os.environ["PTDP_TEST_SLOW_SAVE"].partition(":")
    if (iteration := _iteration_of(kwargs.get("checkpoint_id"))) is not None and iteration >= int(at):
        time.sleep(float(seconds))
    return result


# -- PTDP_TEST_BUG ---------------------------------------------------------------------------------------

def dp_sum_instead_of_average(original, reducer, bucket, *args, **kwargs):
    if reducer.size > 1 and bucket.handle is None and not bucket.synced:
        bucket.grad_data.mul_(reducer.size)  # cancels the 1/d: the reduction sums
    return original(reducer, bucket, *args, **kwargs)


def tp_input_grad_not_reduced(original, ctx, grad):
    return grad, None


# -- the table: environment variable -> (target, wrapper) --------------------------------------------------

PATCHES = {
    "PTDP_TEST_SLOW_RANK": [
        ("ptdp.train.batches:get_microbatch", slow_microbatch),
    ],
    "PTDP_TEST_SLOW_LAYER": [
        ("ptdp.models.gpt:TransformerLayer.forward", slow_layer),
    ],
    "PTDP_TEST_KILL_AT_ITERATION": [
        ("ptdp.train.controller:RunController.before_iteration", kill_at_iteration),
    ],
    "PTDP_TEST_LOOP_AT_ITERATION": [
        ("ptdp.train.controller:RunController.before_iteration", loop_at_iteration),
    ],
    "PTDP_TEST_COMPUTE_AT_ITERATION": [
        ("ptdp.train.controller:RunController.before_iteration", compute_at_iteration),
    ],
    "PTDP_TEST_CRASH_IN_SAVE": [
        ("torch.distributed.checkpoint:save", crash_after_data_files),
        ("ptdp.checkpointing.storage:fsync_and_hash", crash_after_hashing),
        ("ptdp.checkpointing.storage:_fsync", crash_before_latest),
    ],
    "PTDP_TEST_SLOW_SAVE": [
        ("torch.distributed.checkpoint:save", slow_after_data_files),
    ],
    "PTDP_TEST_BUG=dp-sum": [
        ("ptdp.parallel.data.reducer:NoShard._launch", dp_sum_instead_of_average),
    ],
    "PTDP_TEST_BUG=tp-grad": [
        ("ptdp.parallel.collectives:_CopyToRegion.backward", tp_input_grad_not_reduced),
    ],
}


def patch(target: str, wrapper) -> None:
    """Replace ``module:Owner.attr`` by ``wrapper(original, *args, **kwargs)`` (static methods stay static)."""
    module_name, _, path = target.partition(":")
    owner = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    original = getattr(owner, name)
    is_static = inspect.isclass(owner) and isinstance(inspect.getattr_static(owner, name), staticmethod)

    @functools.wraps(original)
    def wrapped(*args, **kwargs):  # a plain function: as a method it binds to the instance
        return wrapper(original, *args, **kwargs)

    setattr(owner, name, staticmethod(wrapped) if is_static else wrapped)


def install() -> None:
    marker = os.environ.get("PTDP_TEST_WORKER_MARKER")
    if marker and "LOCAL_RANK" in os.environ:
        Path(marker, f"worker-{_rank()}").touch()
    if os.environ.get("PTDP_TEST_SLOW_WORKER_START") and "LOCAL_RANK" in os.environ:
        time.sleep(float(os.environ["PTDP_TEST_SLOW_WORKER_START"]))
    for key, patches in PATCHES.items():
        var, _, value = key.partition("=")
        if os.environ.get(var) and (not value or os.environ[var] == value):
            for target, wrapper in patches:
                patch(target, wrapper)


install()
