"""The hang watchdog: a job is hung when no rank has made progress of any kind for ``--hang-timeout-s``.

Each rank runs one :class:`Watchdog` thread. Twice a second it turns the rank's progress counters
(``flight_recorder``: executor actions and layers, communication, iterations, announced phases;
``liveness``: layers, GPU events completed) into "seconds since the last
progress of each kind", and writes a heartbeat to ``RUN/hang/heartbeat-rank<k>.json`` (RUN:
``flight_recorder.run_directory``; removed after a clean exit): pid, host, iteration, operations, those
ages, where its main thread is and whether it waits in communication, the last operations.

A rank that waits (for a peer that computes, for rank 0's announced index build) is not hung while any
rank progresses: a rank silent for the timeout reads every heartbeat and :func:`diagnose` decides. On the
CPU a rank inside one long operation is progressing too, though it ticks nothing until the operation
returns (a matmul of minutes on a loaded machine): its heartbeat makes it :func:`computing` while its
main thread is inside native calls outside communication (``MainThread.native_share``) and the process's
CPU time advances (``cpu_share``, from ``time.process_time``: utime + stime). A stopped process (no heartbeat), one
blocked in a collective (no CPU, or a communication frame) and one whose CPU time stands still are not
computing; nor is one looping in Python (it holds the interpreter lock: no native call). On a GPU the
device's events are the compute progress, so a host spinning in a synchronisation counts for nothing.
Only when every rank has been silent that long (or stopped), it

1. writes this rank's last operations to ``RUN/hang/rank<k>-ops.json`` (a stopped rank's from its last
   heartbeat);
2. names the culprits and the kind of silence: ranks whose heartbeat stopped ("stopped responding": a
   stopped or dead process); else ranks alive but busy outside communication with no progress (a Python
   loop, a deadlock in the rank's own code), with where they are; else (every rank waits in
   communication: a mismatched collective) the ranks at the lowest iteration and fewest operations;
3. the first rank to claim ``RUN/hang/report-attempt<n>.txt`` prints the one line; culprits on this host
   are killed (a stopped process would otherwise hold the launcher's restart for its 30 s grace period);
4. exits with code 3, so torchrun (``--max-restarts``) restarts every worker from the latest checkpoint.

The reporter's exit (or its kill of a culprit) closes the connections the other ranks wait on, so their
communication raises before their own watchdog sees the hang: :meth:`Watchdog.leave_if_reported` makes such
a rank exit 3 quietly too (the training loop calls it when the step raises), so the report stays the one line.

Heartbeats are files in the run directory (``DIR.run`` beside ``--save DIR``): on several nodes it must be
shared storage, which a restart from the latest checkpoint needs anyway.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ptdp.observability import flight_recorder
from ptdp.observability.flight_recorder import COMM, COMPUTE, COUNTS, HANG_EXIT_CODE, ITERATION
from ptdp.observability.liveness import DeviceProgress, MainThread

POLL_S = 0.5
SILENCE = "no layer, executor action, communication, GPU work or iteration"
# The share of one core a rank inside a native call must use to count as computing: far above what the
# watchdog's own thread and idle gloo threads take, far below what an operation gets on a loaded machine.
COMPUTING_CPU_SHARE = 0.02
# The share of the interpreter lock's takes that must find it free for the main thread to be inside native
# calls (``MainThread.native_share``): about 1 there, well under this in a Python loop.
NATIVE_SHARE = 0.5


@dataclass(frozen=True)
class Verdict:
    """Who is hung and what kind of silence was seen."""

    culprits: list[int]
    how: str


def _age(beat: dict, now: float) -> float:
    return max(0.0, now - beat["time"])


def computing(beat: dict) -> bool:
    """Whether a live heartbeat's rank is inside a compute operation: its main thread in a native call,
    outside communication, and its process's CPU time advancing (live work, however long since a tick)."""
    return (bool(beat.get("in_op")) and not beat.get("comm")
            and beat.get("cpu_share", 0.0) >= COMPUTING_CPU_SHARE)


def diagnose(beats: dict[int, dict | None], now: float, timeout_s: float, stale_s: float) -> Verdict | None:
    """None while the job progresses: a rank with a live heartbeat made progress within ``timeout_s``, is
    in an announced phase, or is :func:`computing`. Else the culprits (the module docstring's step 2).
    ``beats``: every rank's latest heartbeat (None: none written). A live heartbeat's silence is its
    ``idle_s`` plus the time since the next one was due: the ``POLL_S`` a heartbeat waits for its successor
    is no silence (counted, a rank ticking every 0.5 s read as silent for 1 s half the time, and was called
    hung under a 1 s timeout). A heartbeat older than ``stale_s`` is a stopped process's, unless the
    process runs on this host (:func:`_running_here`): then its heartbeat thread only waited for a loaded
    CPU, its lateness is no silence either, and it is stopped once its heartbeat is ``timeout_s`` older
    still."""
    here = {r for r, b in beats.items() if b is not None and _running_here(b)}
    alive = {r: b for r, b in beats.items()
             if b is not None and _age(b, now) <= stale_s + (timeout_s if r in here else 0.0)}
    for r, b in alive.items():
        late = 0.0 if r in here else max(0.0, _age(b, now) - POLL_S)
        if b.get("announced") or b["idle_s"] + late < timeout_s or computing(b):
            return None
    stopped = sorted(r for r in beats if r not in alive)
    if stopped:
        ages = [("no heartbeat yet" if beats[r] is None else f"last heartbeat {_age(beats[r], now):.1f} s ago")
                for r in stopped]
        return Verdict(stopped, f"stopped responding ({', '.join(ages)}: the process is stopped or dead)")
    busy = sorted(r for r, b in alive.items() if not b.get("comm"))
    if busy:
        where = "; ".join(alive[r].get("where", "unknown") for r in busy)
        return Verdict(busy, f"alive but silent ({SILENCE}) and not waiting in communication, at {where}")
    low = min((b["iteration"], b["seq"]) for b in alive.values())
    culprits = sorted(r for r, b in alive.items() if (b["iteration"], b["seq"]) == low)
    return Verdict(culprits, "every rank waits in communication; these are at the fewest operations "
                             "(a collective the others never reach?)")


def _running_here(beat: dict) -> bool:
    """Whether the heartbeat's process runs on this host and is neither stopped (SIGSTOP, a debugger),
    nor a zombie, nor gone (Linux ``/proc``; elsewhere, or on another host, False)."""
    if beat.get("host") != socket.gethostname() or "pid" not in beat:
        return False
    try:
        stat = Path(f"/proc/{int(beat['pid'])}/stat").read_text()
    except (OSError, ValueError):
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("T", "t", "Z", "X")


class Watchdog:
    """The heartbeat/hang-detection thread of one rank (see the module docstring). ``device``: on a GPU,
    the :class:`DeviceProgress` the executor's ticks record into."""

    def __init__(self, run_dir: str | Path, rank: int, world_size: int, timeout_s: float,
                 device: DeviceProgress | None = None):
        self.dir = Path(run_dir) / "hang"
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.stale_s = max(1.5, timeout_s / 2)  # a heartbeat older than this: the process stopped
        self.device = device
        self._main = MainThread()
        self._stop = threading.Event()
        self.dir.mkdir(parents=True, exist_ok=True)
        now = time.monotonic()
        self._seen = (tuple(COUNTS), device.completed() if device else 0)
        self._last = {"armed": now}  # kind -> monotonic time of its last change
        flight_recorder.DEVICE[0] = device
        flight_recorder.enable()
        self._thread = threading.Thread(target=self._loop, name="ptdp-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and remove this rank's heartbeat (then the folders, once empty): a run that ends
        leaves no heartbeats; a hang's reports (``rank<k>-ops.json``, ``report-attempt<n>.txt``) stay."""
        self._stop.set()
        flight_recorder._NEW_ITERATION.set()
        self._thread.join(timeout=5)
        flight_recorder.enable(False)
        flight_recorder.DEVICE[0] = None
        (self.dir / f"heartbeat-rank{self.rank}.json").unlink(missing_ok=True)
        for folder in (self.dir, self.dir.parent):
            try:
                folder.rmdir()  # only when empty: the last rank to leave removes them
            except OSError:
                break

    def _sample(self) -> None:
        """Turn counter changes into times (this thread's clock; nothing on the hot path reads one)."""
        now = time.monotonic()
        counts, done = tuple(COUNTS), self.device.completed() if self.device else 0
        (old, old_done) = self._seen
        for kind, index in (("communication", COMM), ("compute", COMPUTE), ("iteration", ITERATION)):
            if counts[index] != old[index]:
                self._last[kind] = now
        if done != old_done:
            self._last["device"] = now
        if flight_recorder.announced():
            self._last["announced"] = now
        self._seen = (counts, done)

    def idle_s(self) -> float:
        return time.monotonic() - max(self._last.values())

    def heartbeat(self) -> dict:
        now, idle_s = time.monotonic(), self.idle_s()
        where, comm = self._main.where()
        # Waiting: the main thread is in a communication call, or blocked (an asynchronous collective's
        # handle, a receive: no CPU). A silent rank that runs is computing when inside a native call
        # (``computing``), else stuck in its own code (a Python loop).
        comm = comm or self._main.cpu_share() < 0.01
        cpu_share = self._main.process_cpu_share()
        # Probed only on the CPU and once the rank is silent a while: a running rank needs no excuse, and
        # the probe takes the interpreter lock from a main thread running Python a few times.
        native = None
        if self.device is None and not comm and idle_s >= min(1.0, self.timeout_s / 2):
            native = self._main.native_share()
        else:
            self._main.forget_native()
        in_op = native is not None and native >= NATIVE_SHARE
        return {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
                "iteration": COUNTS[ITERATION], "seq": COUNTS[COMM], "idle_s": idle_s,
                "ages": {kind: round(now - t, 3) for kind, t in self._last.items()},
                "announced": flight_recorder.announced(), "where": where, "comm": comm,
                "cpu_s": round(time.process_time(), 3), "cpu_share": round(cpu_share, 3), "in_op": in_op,
                "native_share": None if native is None else round(native, 2),
                "ops": flight_recorder.last_operations(16)}

    def _write(self, path: Path, content: dict) -> None:
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(content))
        os.replace(tmp, path)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            beat = self.heartbeat()
            try:
                self._write(self.dir / f"heartbeat-rank{self.rank}.json", beat)
            except OSError:
                pass
            if beat["idle_s"] > self.timeout_s and not self._stop.is_set():
                verdict = diagnose(self._beats(beat), time.time(), self.timeout_s, self.stale_s)
                if verdict is not None:
                    self._hang(beat, verdict)
            self._stop.wait(0.1)  # at most ten heartbeats a second, however fast the iterations
            flight_recorder._NEW_ITERATION.wait(POLL_S - 0.1)
            flight_recorder._NEW_ITERATION.clear()

    @staticmethod
    def forget_reports(run_dir: str | Path) -> None:
        """Remove an earlier job's hang reports and heartbeats (rank 0, as a job starts: before any watchdog
        is armed): a ``report-attempt0.txt`` left by the last job would silence this job's report and make
        :meth:`leave_if_reported` take any error for a peer's hang (a hang's exit leaves heartbeats too)."""
        folder = Path(run_dir) / "hang"
        for old in [*folder.glob("report-attempt*.txt"), *folder.glob("rank*-ops.json"),
                    *folder.glob("heartbeat-rank*.json")]:
            old.unlink(missing_ok=True)

    def _report_path(self) -> Path:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # one report per launcher attempt
        return self.dir / f"report-attempt{attempt}.txt"

    def leave_if_reported(self) -> None:
        """Exit with code 3 at once, printing nothing, when some rank reported a hang in this launcher
        attempt: called when this rank's main thread raised, which then is the report's consequence (a peer
        that exited, or was killed, closed the connection this rank was waiting on), not news of its own."""
        if self._report_path().exists():
            sys.stdout.flush()
            os._exit(HANG_EXIT_CODE)

    def _beats(self, mine: dict) -> dict[int, dict | None]:
        beats: dict[int, dict | None] = {}
        for r in range(self.world_size):
            try:
                beats[r] = mine if r == self.rank else json.loads((self.dir / f"heartbeat-rank{r}.json").read_text())
            except (OSError, ValueError):
                beats[r] = None
        return beats

    def _hang(self, mine: dict, verdict: Verdict) -> None:
        beats = self._beats(mine)
        self._write(self.dir / f"rank{self.rank}-ops.json", {**mine, "ops": flight_recorder.last_operations()})
        for r in verdict.culprits:  # keep a silent process's last operations beside the others' dumps
            if r != self.rank and beats[r] is not None:
                self._write(self.dir / f"rank{r}-ops.json", beats[r])
        ops = mine["ops"]
        doing = "" if self.rank in verdict.culprits else (
            f"; rank {self.rank} waits in {flight_recorder.describe(ops[-1] if ops else None)}" if mine["comm"]
            else f"; rank {self.rank} is at {mine['where']}")
        try:
            fd = os.open(self._report_path(), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            fd = None
        if fd is not None:
            line = (f"hang: rank(s) {', '.join(map(str, verdict.culprits))} {verdict.how}; no rank made progress "
                    f"for over {self.timeout_s:g} s (--hang-timeout-s){doing}; every rank's "
                    f"last operations are in {self.dir}; exiting so the launcher restarts from the latest checkpoint")
            os.write(fd, (line + "\n").encode())
            os.close(fd)
            sys.stderr.write(f"ptdp train: error: {line}\n")
            sys.stderr.flush()
        host = socket.gethostname()
        for r in verdict.culprits:
            b = beats[r]
            if r != self.rank and b is not None and b["host"] == host:
                try:
                    os.kill(b["pid"], signal.SIGKILL)
                except OSError:
                    pass
        os._exit(HANG_EXIT_CODE)
