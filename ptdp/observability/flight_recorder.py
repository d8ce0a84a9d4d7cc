"""Hang detection with a culprit: a per-rank ring buffer of the last communication operations and a
watchdog thread.

Call sites record each communication just before issuing it::

    flight_recorder.record("all_reduce", group=group, tensor=tensor)
    flight_recorder.record("p2p", group=group, peer=peer, tensor=tensor, action="send_forward")

A new record means the previous operation returned, so recording is also *progress*; the training loop
adds ``progress(iteration)`` at every iteration boundary. With ``--hang-timeout-s T`` (> 0) the watchdog
writes a heartbeat per rank every half second to ``RUN/hang/heartbeat-rank<k>.json`` (RUN:
:func:`run_directory`, removed after a clean exit) (pid, host, iteration, the
last operations). When its rank made no progress for T seconds it

1. writes this rank's last operations to ``RUN/hang/rank<k>-ops.json``;
2. reads every rank's heartbeat: ranks whose heartbeat stopped (a stopped or dead process) are the
   culprits; if every process is alive, the ranks at the lowest iteration / fewest operations are;
3. the first rank to claim ``RUN/hang/report-attempt<n>.txt`` prints one line naming the culprit rank(s) and the call
   this rank waits in; stopped culprits on this host are killed (a stopped process would otherwise hold
   the launcher's restart for its 30 s grace period);
4. exits with code 3, so torchrun (``--max-restarts``) restarts every worker from the latest checkpoint.

Heartbeats are files in the run directory (``DIR.run`` beside ``--save DIR``): on several nodes it must be shared
storage, which a restart from the latest checkpoint needs anyway. Recording costs a dict in a deque.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

_OPS: collections.deque = collections.deque(maxlen=64)
_STATE = {"seq": 0, "iteration": 0, "progress": time.monotonic()}
_LOCK = threading.Lock()
_NEW_ITERATION = threading.Event()  # wakes the heartbeat writer, so a heartbeat follows each iteration
HANG_EXIT_CODE = 3


def _group_ranks(group) -> list[int] | None:
    if group is None:
        return None
    try:
        import torch.distributed as dist

        return dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001 - a record must never fail the call it describes
        return None


def record(kind: str, group=None, peer: int | list[int] | None = None, tensor=None, action: str | None = None,
           nbytes: int | None = None) -> None:
    """Record a communication operation about to be issued (and the progress it implies)."""
    if tensor is not None and nbytes is None:
        tensors = tensor if isinstance(tensor, list | tuple) else [tensor]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        shape = [list(t.shape) for t in tensors] if len(tensors) > 1 else list(tensors[0].shape)
    else:
        shape = None
    with _LOCK:
        _STATE["seq"] += 1
        _STATE["progress"] = time.monotonic()
        _OPS.append({"seq": _STATE["seq"], "iteration": _STATE["iteration"], "kind": kind,
                     "group": _group_ranks(group), "peer": peer, "shape": shape, "bytes": nbytes,
                     "action": action, "time": time.time()})


def progress(iteration: int) -> None:
    """The training loop reached ``iteration``."""
    with _LOCK:
        new = _STATE["iteration"] != iteration
        _STATE["iteration"] = iteration
        _STATE["progress"] = time.monotonic()
    if new:
        _NEW_ITERATION.set()


def last_operations() -> list[dict]:
    with _LOCK:
        return list(_OPS)


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


class Watchdog:
    """The heartbeat/hang-detection thread of one rank (see the module docstring)."""

    def __init__(self, run_dir: str | Path, rank: int, world_size: int, timeout_s: float):
        self.dir = Path(run_dir) / "hang"
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.stale_s = max(1.5, min(3.0, timeout_s / 2))  # a heartbeat older than this: the process stopped
        self._stop = threading.Event()
        self.dir.mkdir(parents=True, exist_ok=True)
        progress(_STATE["iteration"])
        self._thread = threading.Thread(target=self._loop, name="ptdp-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and remove this rank's heartbeat (then the folders, once empty): a run that ends
        leaves no heartbeats; a hang's reports (``rank<k>-ops.json``, ``report-attempt<n>.txt``) stay."""
        self._stop.set()
        _NEW_ITERATION.set()
        self._thread.join(timeout=5)
        (self.dir / f"heartbeat-rank{self.rank}.json").unlink(missing_ok=True)
        for folder in (self.dir, self.dir.parent):
            try:
                folder.rmdir()  # only when empty: the last rank to leave removes them
            except OSError:
                break

    def _heartbeat(self) -> dict:
        with _LOCK:
            return {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
                    "iteration": _STATE["iteration"], "seq": _STATE["seq"], "ops": list(_OPS)[-16:]}

    def _write(self, path: Path, content: dict) -> None:
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(content))
        os.replace(tmp, path)

    def _loop(self) -> None:
        while True:
            try:
                self._write(self.dir / f"heartbeat-rank{self.rank}.json", self._heartbeat())
            except OSError:
                pass
            _NEW_ITERATION.wait(0.5)
            _NEW_ITERATION.clear()
            if self._stop.is_set():
                return
            if time.monotonic() - _STATE["progress"] > self.timeout_s and not self._stop.is_set():
                self._hang()

    def _hang(self) -> None:
        mine = self._heartbeat()
        self._write(self.dir / f"rank{self.rank}-ops.json", {**mine, "ops": last_operations()})
        beats = {}
        for r in range(self.world_size):
            try:
                beats[r] = json.loads((self.dir / f"heartbeat-rank{r}.json").read_text())
            except (OSError, ValueError):
                beats[r] = None
        now = time.time()
        stopped = [r for r, b in beats.items() if r != self.rank and (b is None or now - b["time"] > self.stale_s)]
        if stopped:
            culprits, how = stopped, "stopped responding (no heartbeat)"
        else:
            low = min((b["iteration"], b["seq"]) for b in beats.values() if b)
            culprits = [r for r, b in beats.items() if b and (b["iteration"], b["seq"]) == low]
            how = "fell behind (alive, but at the fewest operations)"
        for r in stopped:  # keep the stopped process's last operations beside the others' dumps
            if beats[r] is not None:
                self._write(self.dir / f"rank{r}-ops.json", beats[r])
        waiting = describe(mine["ops"][-1] if mine["ops"] else None)
        try:
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # one report per launcher attempt
            fd = os.open(self.dir / f"report-attempt{attempt}.txt", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            fd = None
        if fd is not None:
            line = (f"hang: rank(s) {', '.join(map(str, culprits))} {how} for over {self.timeout_s:g} s "
                    f"(--hang-timeout-s); rank {self.rank} waits in {waiting}; every rank's last operations are "
                    f"in {self.dir}; exiting so the launcher restarts from the latest checkpoint")
            os.write(fd, (line + "\n").encode())
            os.close(fd)
            sys.stderr.write(f"ptdp: error: {line}\n")
            sys.stderr.flush()
        host = socket.gethostname()
        for r in stopped:
            b = beats[r]
            if b is not None and b["host"] == host:
                try:
                    os.kill(b["pid"], signal.SIGKILL)
                except OSError:
                    pass
        os._exit(HANG_EXIT_CODE)
