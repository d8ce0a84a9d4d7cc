"""``ptdp train --nproc-per-node N --fault-tolerant-replicas R`` on one machine: torchft's lighthouse in
this process and R replica groups, each ``ptdp train --nproc-per-node N/R`` of its own (its own torchrun
agent, world, store and ``--max-restarts``), so a failed group is restarted alone while the others go on.

Group g runs with ``PTDP_REPLICA_GROUP=g`` and ``TORCHFT_LIGHTHOUSE`` set; groups other than 0 write their
metrics and checkpoints beside the run's (``NAME-replica{g}``), so that no two groups write one file. Across
machines the same is done by hand: one lighthouse, one ``torchrun`` per group (docs/multinode.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

GROUP_ENV = "PTDP_REPLICA_GROUP"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


def torchft_problem() -> str | None:
    """One line when torchft cannot be imported (None when it can)."""
    # torchft's servers (the lighthouse here, the managers in the workers, which inherit this) log every
    # quorum and commit at INFO: warnings only, unless RUST_LOG says otherwise. Read at its first import.
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft  # noqa: F401
    except ImportError as e:
        return (f"--fault-tolerant-replicas needs torchft (pip install 'torchft==0.2.0', or ptdp's [ft] extra): "
                f"{e}")
    return None


def beside(path: str, group: int) -> str:
    """Group ``group``'s own file or directory next to ``path``: ``metrics.jsonl`` -> ``metrics-replica1.jsonl``."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}-replica{group}{p.suffix}")) if p.suffix else f"{path}-replica{group}"


def group_argv(argv: list[str], nproc_per_group: int, group: int, save: str | None, metrics: str | None,
               load: str | None = None) -> list[str]:
    """The command line of group ``group``: ours with ``--nproc-per-node`` the group's, and its own files
    (``--load`` too when it continues ``--save``: each group resumes its own directory)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg.split("=", 1)[0] == "--nproc-per-node":
            skip = "=" not in arg
            continue
        out.append(arg)
    out += ["--nproc-per-node", str(nproc_per_group)]
    if group and save:
        out += ["--save", beside(save, group)]
        if load is not None and Path(load).resolve() == Path(save).resolve():
            out += ["--load", beside(save, group)]
    if group and metrics:
        out += ["--metrics-file", beside(metrics, group)]
    return out


def launch_replica_groups(argv: list[str], nproc_per_node: int, replicas: int, save: str | None,
                          metrics: str | None, load: str | None = None, heartbeat_timeout_s: float = 5.0,
                          join_timeout_s: float = 60.0) -> int:
    """Start the lighthouse and the R groups; wait for all; the job's exit code (the first non-zero one).

    The lighthouse forms a quorum of at least one group: when every group still sending heartbeats has
    joined, else ``join_timeout_s`` after the first (a slow starter is waited for; a dead group stops its
    heartbeats and is out after ``heartbeat_timeout_s``)."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=int(join_timeout_s * 1000),
                                  heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))
    address = lighthouse.address()
    print(f"ptdp train: torchft lighthouse at {address}; {replicas} replica groups of {nproc_per_node // replicas} "
          "worker(s) each", flush=True)
    procs = []
    try:
        for group in range(replicas):
            env = {**os.environ, GROUP_ENV: str(group), LIGHTHOUSE_ENV: address}
            command = [sys.executable, "-m", "ptdp",
                       *group_argv(argv, nproc_per_node // replicas, group, save, metrics, load)]
            procs.append(subprocess.Popen(command, env=env))
        codes = _wait(procs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
        lighthouse.shutdown()
    return next((code for code in codes if code), 0)


def _wait(procs: list[subprocess.Popen]) -> list[int]:
    """Every group's exit code. A group that exits 2 (bad input, said in its own line) ends the job: the
    others would only wait for it at their first quorum. Any other failure leaves them training."""
    while any(proc.poll() is None for proc in procs):
        if any(proc.poll() == 2 for proc in procs):
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
        time.sleep(0.2)
    return [proc.returncode for proc in procs]
