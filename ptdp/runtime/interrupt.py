"""Ctrl-C at any moment: one line saying what happened and what was saved, exit 130, within seconds.

Why not Python's ``KeyboardInterrupt``: it is raised wherever the main thread happens to be, so on a
multi-process run one rank unwinds out of a collective while its peers fail in theirs, every rank prints a
traceback, and the work since the last periodic save is lost. And a Python handler waits for the main
thread: a rank inside a rendezvous or a collective (a C call) would not see the signal until it returned,
which is how a Ctrl-C during start-up was lost. So SIGINT goes through :mod:`ptdp.runtime.signals` (a
thread acts on it at once), and:

- **A worker** (``ptdp train`` in one process, or each rank under the launcher): a first SIGINT once the
  loop trains (:func:`training`) only sets a flag; the run controller ORs it over all ranks at the next
  iteration boundary (the tiny all-reduce that also agrees on SIGTERM and NaN), the ranks save when
  ``--save`` is set and stop, and the line is :func:`stop_line` (``stopped at iteration N; saved to
  DIR/iter_000000N``). A SIGINT before that (launch, rendezvous, data, model build, loading), or a second
  one, stops at once (:func:`stop_now`): ``os._exit`` on every rank, no traceback, no teardown; a save cut
  short leaves only a ``.tmp-iter_*`` directory that the next start removes, ``latest`` still naming the
  previous checkpoint. The line is :func:`immediate_line`.
- **The launcher** (``ptdp train --nproc-per-node N``; :mod:`ptdp.runtime.launcher_stop`) is the one
  process the terminal talks to: torchrun starts the workers in sessions of their own. It passes each
  SIGINT on to the workers, and prints the one line itself: rank 0 leaves what it knows (phase, iteration,
  the final line) in ``PTDP_STATUS_FILE``, so workers print nothing. A worker is passed a SIGINT only once
  it has said (a file named after its pid in ``PTDP_READY_DIR``) that ptdp's handler is in: before that,
  inside the interpreter's own start-up, a SIGINT is Python's KeyboardInterrupt, a fatal error with a
  traceback. The wait is a fraction of a second; a worker that never says so is passed the signal after
  :data:`NOTICE_S` all the same. The launcher's monitor enforces the promise: workers that are still there
  2 s after a peer left (they wait for it in a collective), or 2 s after a second Ctrl-C, are killed; a
  third Ctrl-C kills them at once. Workers exit 0 to torchrun (a non-zero exit is a failure it would
  restart) and the launcher exits 130.

A graceful stop that takes more than :data:`NOTICE_S` (a long iteration, a big save) says so once, so the
terminal is never silent for long. Processes launched by ptdp know it from ``PTDP_LAUNCHER_PID``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

from ptdp.runtime import signals
from ptdp.runtime.errors import write_line

EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for a process stopped by Ctrl-C
LAUNCHER_ENV = "PTDP_LAUNCHER_PID"
STATUS_ENV = "PTDP_STATUS_FILE"  # where rank 0 tells the launcher what a stop left behind
READY_ENV = "PTDP_READY_DIR"  # where each worker marks that a SIGINT reaches ptdp's handler, not Python's
NOTICE_S = 5.0  # a graceful stop still running after this long says what it waits for
GRACE_S = 2.0  # the launcher kills workers left this long after a peer (or the second Ctrl-C) stopped

_STATE: dict = {"count": 0, "phase": "setup", "rank": 0, "iteration": None, "save": None, "loaded": 0,
                "stop": None}


def launched() -> bool:
    """Whether this process is a worker of ``ptdp train --nproc-per-node`` (which reports the 130)."""
    return LAUNCHER_ENV in os.environ


def quiet_exit_handler(command: str = "ptdp"):
    """A SIGINT handler for the commands without a graceful stop: one line, exit 130, no traceback."""

    def handler(signum, frame) -> None:
        _write(f"{command}: interrupted")
        os._exit(EXIT_CODE)

    return handler


def install_for_command(argv: list[str]) -> None:
    """Ctrl-C before a command installs its own handling (imports, argument parsing, or a command without
    a graceful stop): one line, exit 130. ``ptdp train`` acts on it from a thread at once: a SIGINT before
    :func:`install` stops at once (worker or launcher: either has nothing to save yet)."""
    command = argv[0] if argv and not argv[0].startswith("-") else None
    if command != "train":
        signal.signal(signal.SIGINT, quiet_exit_handler("ptdp" + (f" {command}" if command else "")))
    elif not signals.installed(signal.SIGINT):
        _STATE.update(rank=int(os.environ.get("RANK", "0")))
        signals.on(signal.SIGINT, _worker_signal)  # before the signal is routed: none arrives unheard
        signals.install(signal.SIGINT)
        _say_ready()


def _say_ready() -> None:
    """Under the launcher: tell it that from now on a SIGINT reaches :func:`_worker_signal`."""
    ready = os.environ.get(READY_ENV)
    if ready and launched():
        try:
            Path(ready, str(os.getpid())).touch()
        except OSError:
            pass  # the launcher passes the signal on after NOTICE_S anyway


def know_save(save: str | None) -> None:
    """``--save``, as soon as the arguments are parsed: what a stop at once says is (not) on disk."""
    _STATE["save"] = save


def install(rank: int, save: str | None) -> None:
    """This worker's SIGINT handling (main thread only, as Python requires)."""
    _STATE.update(count=0, phase="setup", rank=rank, iteration=None, save=save, loaded=0, stop=None)
    signals.on(signal.SIGINT, _worker_signal)
    signals.install(signal.SIGINT)


def requested() -> bool:
    """Whether a SIGINT reached this process (the run controller agrees on it with every rank)."""
    return _STATE["count"] > 0


def loaded(iteration: int) -> None:
    """The run resumed from the checkpoint of ``iteration`` (0: from scratch)."""
    _STATE["loaded"] = iteration


def training(iteration: int) -> None:
    """The loop starts ``iteration``: from now on a first SIGINT is a graceful stop."""
    if _STATE["phase"] in ("setup", "training"):
        _STATE["phase"] = "training"
    _STATE["iteration"] = iteration


def stopped(iteration: int, saved: bool) -> None:
    """Every rank: the run stops after ``iteration`` because of a SIGINT (``saved``: with a checkpoint)."""
    _STATE["stop"] = (iteration, saved)
    _STATE["phase"] = "stopping"


def exit_code() -> int | None:
    """After ``train`` returned: None when no SIGINT stopped it, else this process's exit code (rank 0
    has reported :func:`stop_line` by then)."""
    if _STATE["stop"] is None:
        return None
    if _STATE["rank"] == 0:
        _report(stop_line(*_STATE["stop"], _STATE["save"], _STATE["loaded"]), final=True)
    return 0 if launched() else EXIT_CODE


def stop_line(iteration: int, saved: bool, save: str | None, loaded: int = 0) -> str:
    """The one line of a graceful stop."""
    if saved and save:
        return f"ptdp train: stopped at iteration {iteration}; saved to {Path(save) / f'iter_{iteration:07d}'}"
    return f"ptdp train: stopped at iteration {iteration}; {_nothing_saved(save, loaded)}"


def immediate_line(phase: str, iteration: int | None, save: str | None, loaded: int = 0,
                   step: str | None = None) -> str:
    """The one line of a stop at once (a SIGINT before training, or a second one); ``step``: the start-up
    step under way (``ptdp.runtime.phases``)."""
    if phase == "setup" or iteration is None:
        during = f" ({step})" if step else ""
        return f"ptdp train: stopped at once during start-up{during}; {_nothing_saved(save, loaded)}"
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


def _worker_signal(signum: int) -> None:
    _STATE["count"] += 1
    if _STATE["count"] == 1 and _STATE["phase"] == "training":
        _report(None)  # the launcher learns the phase now, in case it has to stop us
        if not launched() and _STATE["rank"] == 0:  # one process: it talks to the terminal itself
            notice = threading.Timer(NOTICE_S, _notice)
            notice.daemon = True
            notice.start()
        return
    stop_now()


def _notice() -> None:
    if _STATE["stop"] is None:
        _write(f"ptdp train: Ctrl-C: finishing iteration {_STATE['iteration']}, then saving (if --save) and "
               "stopping; Ctrl-C again stops at once")


def stop_now() -> None:
    """Leave at once on this rank: rank 0 says what is on disk; no traceback, no teardown."""
    if _STATE["rank"] == 0:  # under the launcher, it words the line (it knows --save from the start)
        line = immediate_line(_STATE["phase"], _STATE["iteration"], _STATE["save"], _STATE["loaded"],
                              step_under_way())
        _report(line, final=not launched())
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    os._exit(0 if launched() else EXIT_CODE)


def interrupted_exception(error: BaseException) -> bool:
    """Whether ``error`` is a consequence of a SIGINT (a peer that left at once closed its connections):
    then the caller leaves quietly with :func:`stop_now` instead of printing it."""
    return requested() and not isinstance(error, SystemExit)


def _report(line: str | None, final: bool = False) -> None:
    """Rank 0: the line of this stop. Under the launcher it goes to the status file (the launcher prints
    it), with the phase, so that the launcher can word the line itself if it has to kill this process."""
    path = os.environ.get(STATUS_ENV)
    if not launched() or not path:
        if line is not None:
            _write(line)
        return
    status = {"phase": _STATE["phase"], "iteration": _STATE["iteration"], "loaded": _STATE["loaded"],
              "step": step_under_way(), "line": line if final else None}
    try:
        tmp = f"{path}.{os.getpid()}"
        Path(tmp).write_text(json.dumps(status))
        os.replace(tmp, path)
    except OSError:
        pass


def step_under_way() -> str | None:
    """The start-up step under way, lowercase and without the first iteration's own phase."""
    from ptdp.runtime.phases import current

    step = current()
    return None if step is None or step.startswith("iteration ") else step


def _write(line: str) -> None:
    write_line(sys.stderr, line)
