"""Ctrl-C as a graceful stop: the first SIGINT finishes the current iteration, saves and exits 130.

Why not Python's ``KeyboardInterrupt``: it is raised wherever the main thread happens to be, so on a
multi-process run one rank unwinds out of a collective while its peers fail in theirs ("Connection closed
by peer"), every rank prints a traceback, and the work since the last periodic save is lost. Instead:

- **Workers** (``ptdp train`` in one process, or each rank under the launcher) install :func:`install`.
  The first SIGINT only sets a flag. The training loop's checkpoint manager ORs it over all ranks at the
  next iteration boundary (the same tiny all-reduce that agrees on SIGTERM), saves when ``--save`` is set
  and stops; rank 0 then prints one line, :func:`stop_line` ("stopped at iteration N; saved to
  DIR/iter_000000N"), and the process exits 130. A SIGINT before training started, or a second one, stops
  at once: one line (:func:`immediate_line`) from rank 0, ``os._exit`` on every rank (no traceback, no
  gloo teardown), and a save cut short leaves only a ``.tmp-iter_*`` directory that the next start removes
  (``latest`` still names the previous complete checkpoint).
- **The launcher** (``ptdp train --nproc-per-node N``) starts its workers in sessions of their own
  (torchrun does), so a terminal's Ctrl-C reaches the launcher alone. :func:`install_launcher` passes
  each SIGINT on to the workers itself (torchrun's handler would turn it into a shutdown with a 30 s kill
  timer and tracebacks); the workers exit 0 to the agent (a non-zero exit would be a failure it restarts)
  and the launcher exits 130. A third Ctrl-C kills the workers.

Processes launched by ptdp know it from ``PTDP_LAUNCHER_PID`` in their environment.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from ptdp.runtime.errors import write_line

EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for a process stopped by Ctrl-C
LAUNCHER_ENV = "PTDP_LAUNCHER_PID"

_STATE: dict = {"count": 0, "phase": "setup", "rank": 0, "iteration": None, "save": None, "loaded": 0,
                "stop": None}


def launched() -> bool:
    """Whether this process is a worker of ``ptdp train --nproc-per-node`` (which reports the 130)."""
    return LAUNCHER_ENV in os.environ


def quiet_exit_handler(command: str = "ptdp"):
    """A SIGINT handler for the commands without a graceful stop: one line, exit 130, no traceback."""

    def handler(signum, frame) -> None:
        if command != "ptdp train":
            _write(f"{command}: interrupted")
        elif int(os.environ.get("RANK", "0")) == 0:  # a worker still importing, before install()
            _write(immediate_line("setup", None, None))
        os._exit(0 if launched() else EXIT_CODE)

    return handler


def install(rank: int, save: str | None) -> None:
    """This worker's SIGINT handler (main thread only, as Python requires)."""
    _STATE.update(count=0, phase="setup", rank=rank, iteration=None, save=save, loaded=0, stop=None)
    signal.signal(signal.SIGINT, _worker_handler)


def requested() -> bool:
    """Whether a SIGINT reached this process (the manager agrees on it with every rank)."""
    return _STATE["count"] > 0


def loaded(iteration: int) -> None:
    """The run resumed from the checkpoint of ``iteration`` (0: from scratch)."""
    _STATE["loaded"] = iteration


def training(iteration: int) -> None:
    """The loop starts ``iteration``: from now on a first SIGINT is a graceful stop."""
    if _STATE["phase"] == "setup" or _STATE["phase"] == "training":
        _STATE["phase"] = "training"
    _STATE["iteration"] = iteration


def stopped(iteration: int, saved: bool) -> None:
    """Every rank: the run stops after ``iteration`` because of a SIGINT (``saved``: with a checkpoint)."""
    _STATE["stop"] = (iteration, saved)
    _STATE["phase"] = "stopping"


def exit_code() -> int | None:
    """After ``train`` returned: None when no SIGINT stopped it, else this process's exit code (rank 0
    has printed :func:`stop_line` by then)."""
    if _STATE["stop"] is None:
        return None
    if _STATE["rank"] == 0:
        _write(stop_line(*_STATE["stop"], _STATE["save"], _STATE["loaded"]))
    return 0 if launched() else EXIT_CODE


def stop_line(iteration: int, saved: bool, save: str | None, loaded: int = 0) -> str:
    """The one line of a graceful stop."""
    if saved and save:
        return f"ptdp train: stopped at iteration {iteration}; saved to {Path(save) / f'iter_{iteration:07d}'}"
    return f"ptdp train: stopped at iteration {iteration}; {_nothing_saved(save, loaded)}"


def immediate_line(phase: str, iteration: int | None, save: str | None, loaded: int = 0) -> str:
    """The one line of a stop at once (a SIGINT during start-up, or a second one)."""
    if phase == "setup" or iteration is None:
        return "ptdp train: stopped at once during start-up; nothing saved"
    return f"ptdp train: stopped at once in iteration {iteration}; {_nothing_saved(save, loaded)}"


def _nothing_saved(save: str | None, loaded: int) -> str:
    latest = _latest(save) if save else None
    if latest:
        return f"nothing saved since iteration {latest} ({Path(save) / f'iter_{latest:07d}'})"
    if loaded:
        return f"nothing saved since iteration {loaded}" + ("" if save else " (no --save)")
    return "nothing saved" + ("" if save else " (no --save)")


def _latest(save: str) -> int | None:
    try:
        text = (Path(save) / "latest").read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _worker_handler(signum, frame) -> None:
    _STATE["count"] += 1
    if _STATE["count"] == 1 and _STATE["phase"] != "setup":
        if not launched() and _STATE["rank"] == 0:  # one process: it is the one the terminal talks to
            _write("ptdp train: Ctrl-C: finishing this iteration, then saving (if --save) and stopping; "
                   "Ctrl-C again stops at once")
        return
    stop_now()


def stop_now() -> None:
    """Leave at once on this rank: rank 0 says what is on disk; no traceback, no teardown."""
    if _STATE["rank"] == 0:
        _write(immediate_line(_STATE["phase"], _STATE["iteration"], _STATE["save"], _STATE["loaded"]))
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    os._exit(0 if launched() else EXIT_CODE)


def interrupted_exception(error: BaseException) -> bool:
    """Whether ``error`` is a consequence of a SIGINT (a peer that left at once closed its connections):
    then the caller leaves quietly with :func:`stop_now` instead of printing it."""
    return requested() and not isinstance(error, SystemExit)


def _write(line: str) -> None:
    write_line(sys.stderr, line)


# --- the launcher's side -------------------------------------------------------------------------------

_LAUNCHER: dict = {"count": 0}


def install_launcher() -> None:
    """Pass SIGINT on to the workers (see the module docstring); torchrun keeps SIGTERM and the rest."""
    _LAUNCHER["count"] = 0
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    signal.signal(signal.SIGINT, _launcher_handler)


def launcher_interrupted() -> bool:
    return _LAUNCHER["count"] > 0


def _launcher_handler(signum, frame) -> None:
    _LAUNCHER["count"] += 1
    workers = _children()
    if not workers:  # the workers are not running (yet): nothing to finish
        _write("ptdp train: stopped at once during start-up; nothing saved")
        os._exit(EXIT_CODE)
    count = _LAUNCHER["count"]
    if count == 1:
        _write("ptdp train: Ctrl-C: the workers finish their current iteration, then save (if --save) and "
               "stop; Ctrl-C again stops at once")
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL if count >= 3 else signal.SIGINT)
        except OSError:
            pass
    if count >= 3:
        _write("ptdp train: workers killed")
        os._exit(EXIT_CODE)


def _children() -> list[int]:
    """This process's child processes (Linux /proc): the workers torchrun started."""
    me, out = os.getpid(), []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and int(fields[1]) == me:
            out.append(int(entry))
    return out
