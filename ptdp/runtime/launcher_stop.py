"""The launcher's side of a Ctrl-C (:mod:`ptdp.runtime.interrupt` tells the whole story): pass each SIGINT
on to the workers once they can take it, kill what is left when the promise runs out, print the one line
and exit 130."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from ptdp.runtime import interrupt, signals
from ptdp.runtime.errors import write_line


class _Stop:
    """The launcher's stop in progress (see the module docstring): one per run, made by the first SIGINT."""

    def __init__(self, save: str | None, status: str) -> None:
        self.save, self.status = save, status
        self.count, self.started = 0, time.monotonic()
        self.second: float | None = None
        self.workers = _children()
        self.told: set[int] = set()  # the workers passed the first SIGINT
        self._passing = threading.Lock()  # the signal thread and the monitor both pass SIGINT on
        self.first_exit: float | None = None
        self._done = threading.Lock()
        self._noticed = False

    def signal(self) -> None:
        self.count += 1
        if self.count == 1:
            if not self.workers:  # none started (yet): one may be forking right now, so look again
                time.sleep(0.3)
                self.workers = _children()
            if not self.workers:
                self.finish()
            threading.Thread(target=self._monitor, name="ptdp-stop", daemon=True).start()
        elif self.count == 2:
            self.second = time.monotonic()
        if self.count >= 3:
            for pid in self.workers:
                _kill(pid, signal.SIGKILL)
            self.finish()
        self._pass_on(every=True)

    def _pass_on(self, every: bool = False) -> None:
        """SIGINT to each worker whose handler is in (``every``: again to those told already). One that
        is not ready yet is still starting Python, so the first SIGINT it gets stops it at once."""
        waited = time.monotonic() - self.started > interrupt.NOTICE_S
        with self._passing:
            for pid in self.workers:
                if (every or pid not in self.told) and (waited or _ready(pid)):
                    self.told.add(pid)
                    _kill(pid, signal.SIGINT)

    def _monitor(self) -> None:
        while True:
            time.sleep(0.05)
            self._pass_on()
            alive = [pid for pid in self.workers if _running(pid)]
            now = time.monotonic()
            if not alive:
                self.finish()
            if len(alive) < len(self.workers) and self.first_exit is None:
                self.first_exit = now
            late = [t for t in (self.first_exit, self.second) if t is not None and now - t > interrupt.GRACE_S]
            if late:  # waiting for a peer that left, or still there after a second Ctrl-C
                self.finish()
            if not self._noticed and self.count == 1 and now - self.started > interrupt.NOTICE_S:
                self._noticed = True
                status = self._status()
                if status.get("phase") == "training":
                    _write(f"ptdp train: Ctrl-C: the workers finish iteration {status.get('iteration')}, then save "
                           "(if --save) and stop; Ctrl-C again stops at once")

    def _status(self) -> dict:
        try:
            return json.loads(Path(self.status).read_text())
        except (OSError, ValueError):
            return {}

    def finish(self) -> None:
        """Kill what is left, print the one line, exit 130 (once, from whichever thread gets here)."""
        if not self._done.acquire(blocking=False):
            time.sleep(60)  # the other thread is exiting the process
            return
        _quiet_torchrun()
        pids = self.workers + _children()
        status = self._status()
        line = status.get("line") or interrupt.immediate_line(status.get("phase", "setup"), status.get("iteration"),
                                                     self.save, status.get("loaded") or 0,
                                                     status.get("step") or interrupt.step_under_way())
        _write(line)
        close_launcher()
        # Last, with no call between that could let torchrun's thread see a killed worker and restart it.
        for pid in pids:
            _kill(pid, signal.SIGKILL)
        os._exit(interrupt.EXIT_CODE)


# the loggers of torchrun's agent, which the launcher keeps off the terminal
TORCHRUN_LOGGERS = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")
_LAUNCHER: dict = {"stop": None, "save": None, "status": None, "ready": None}


def install_launcher(save: str | None) -> None:
    """Pass SIGINT on to the workers and report their stop (see the module docstring); torchrun keeps
    SIGTERM and the rest. ``save``: ``--save``, to say what is on disk."""
    fd, status = tempfile.mkstemp(prefix="ptdp-status-", suffix=".json")
    os.close(fd)
    os.unlink(status)  # rank 0 creates it when it has something to say
    ready = tempfile.mkdtemp(prefix="ptdp-ready-")
    _LAUNCHER.update(stop=None, save=save, status=status, ready=ready)
    os.environ[interrupt.LAUNCHER_ENV] = str(os.getpid())
    os.environ[interrupt.STATUS_ENV] = status
    os.environ[interrupt.READY_ENV] = ready
    signals.on(signal.SIGINT, _launcher_signal)
    signals.install(signal.SIGINT)


def close_launcher() -> None:
    """Remove the launcher's status file and ready directory (the run is over)."""
    if _LAUNCHER["status"]:
        Path(_LAUNCHER["status"]).unlink(missing_ok=True)
    if _LAUNCHER["ready"]:
        shutil.rmtree(_LAUNCHER["ready"], ignore_errors=True)


def launcher_interrupted() -> bool:
    return _LAUNCHER["stop"] is not None


def finish_launcher_stop() -> None:
    """torchrun returned after a Ctrl-C (the workers stopped, exit 0): print the line and exit 130."""
    stop = _LAUNCHER["stop"]
    if stop is not None:
        stop.finish()


def _launcher_signal(signum: int) -> None:
    if _LAUNCHER["stop"] is None:
        _LAUNCHER["stop"] = _Stop(_LAUNCHER["save"], _LAUNCHER["status"])
    _LAUNCHER["stop"].signal()


def _quiet_torchrun() -> None:
    """Nothing from torchrun's loggers once we stop the workers ourselves."""
    import logging

    for name in TORCHRUN_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def _ready(pid: int) -> bool:
    """Whether worker ``pid`` said its SIGINT handler is in (:func:`ptdp.runtime.interrupt.install_for_command`)."""
    return os.path.exists(os.path.join(_LAUNCHER["ready"] or "", str(pid)))


def _running(pid: int) -> bool:
    """Whether ``pid`` is alive (a zombie, exited but not yet reaped by torchrun, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _children() -> list[int]:
    """This process's running child processes (Linux /proc): the workers torchrun started."""
    me, out = os.getpid(), []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and int(fields[1]) == me and fields[0] != "Z":
            out.append(int(entry))
    return out


def _write(line: str) -> None:
    write_line(sys.stderr, line)
