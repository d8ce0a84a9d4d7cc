"""How long an elastic restart takes: a node lost (scale-down), then a node joining (scale-up).

    python benchmarks/elastic.py [--json] [--nproc-per-node 1] [--repeats 1]

Two ``ptdp train --nnodes 1:2`` agents (the tiny test model, p = 1, d = 2 x nproc, a checkpoint every
iteration) meet through a c10d rendezvous this script hosts. Once iteration 2 is saved, one agent and its
workers are SIGKILLed; once the survivor has logged an iteration at the smaller size, a third agent joins.
Printed, from the kill: ``detect_s`` until the survivor's agent sees its workers fail, ``loaded_s`` until
the restarted workers have loaded the resharded checkpoint, ``first_s`` until the first iteration at the new
size is logged. From the join: ``join_first_s`` until the first iteration at the grown size, and
``join_stall_s``, the gap the running job saw between its last iteration before and its first after (the
survivor's workers save on the agent's SIGTERM, so no iteration is lost). ``iteration_s`` (the median step
at the grown size) is the baseline the times are divided by. The rendezvous options are the test's
(``last_call_timeout=1``, dead node after 5 missed 1-s heartbeats): the restart waits for the dead node's
heartbeats to expire, so ``keep_alive_interval x keep_alive_max_attempt`` is a floor under ``loaded_s``,
and ``last_call_timeout`` one under ``join_stall_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "1e-3", "--lr-warmup-iters", "1",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--train-iters", "40"]
RDZV_CONF = "is_host=0,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5,join_timeout=120"


def wait(condition, timeout: float = 300) -> float:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the elastic run did not get there in time")
        time.sleep(0.02)
    return time.monotonic()


def kill(agent: subprocess.Popen) -> None:
    """SIGKILL an agent and its workers (torchrun starts each worker in a session of its own); also used
    by tests/resilience/test_elastic.py."""
    children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children")
    workers = [int(pid) for pid in children.read_text().split()] if children.exists() else []
    for group in (agent.pid, *workers):
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    agent.wait(timeout=30)


def measure(tmp: Path, nproc: int) -> dict:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    ckpt, metrics = tmp / "ckpt", tmp / "metrics.jsonl"
    args = ["train", *TINY, "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "1",
            "--metrics-file", str(metrics), "--nnodes", "1:2", "--nproc-per-node", str(nproc),
            "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-id", "bench", "--rdzv-conf", RDZV_CONF,
            "--monitor-interval", "0.1", "--max-restarts", "1"]
    # a few seconds of training to kill a node in: tests/faults slows every step (PTDP_TEST_SLOW_RANK)
    faults = str(Path(__file__).resolve().parents[1] / "tests" / "faults")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PTDP_TEST_SLOW_RANK": "*:0.2",
           "PYTHONPATH": os.pathsep.join(p for p in (faults, os.environ.get("PYTHONPATH")) if p)}
    logs = {name: tmp / f"{name}.log" for name in "abc"}
    agents: dict[str, subprocess.Popen] = {}

    def start(name: str) -> None:
        agents[name] = subprocess.Popen([sys.executable, "-m", "ptdp", *args], stdout=logs[name].open("w"),
                                        stderr=subprocess.STDOUT, env=env, start_new_session=True)

    seen: list[tuple[float, dict]] = []  # (when first seen, record): polled, since records carry no time
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            complete = metrics.read_text().rpartition("\n")[0] if metrics.exists() else ""
            for line in complete.splitlines()[len(seen):]:
                seen.append((time.monotonic(), json.loads(line)))
            time.sleep(0.01)

    def text() -> str:
        return "".join(logs[name].read_text() for name in agents)

    def first_iteration_after(marker: str) -> int:
        """Wait for the reshard line ``marker``, then for the iteration after the checkpoint it loaded;
        its index in ``seen``."""
        wait(lambda: marker in text())
        resumed = int(text().split(marker)[0].rsplit("at iteration ", 1)[1].split()[0])
        count = len(seen)
        wait(lambda: any(r["iteration"] == resumed + 1 for _, r in seen[count:]))
        return next(i for i in range(count, len(seen)) if seen[i][1]["iteration"] == resumed + 1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        start("a")
        start("b")
        wait(lambda: (ckpt / "iter_0000002").exists())
        killed = time.monotonic()
        kill(agents["b"])  # returns once the agent is reaped: the survivor may have noticed by then
        # The agent logs a worker's failure, or its stopping of the others when one failed first.
        detected = wait(lambda: re.search(r"failed \(exitcode|closing signal SIGTERM", logs["a"].read_text()))
        loaded = wait(lambda: "to t=1 p=1 d=" in text())
        first = seen[first_iteration_after("to t=1 p=1 d=")][0]
        start("c")
        joined = time.monotonic()
        grown = first_iteration_after(f"from t=1 p=1 d={nproc} to")
        wait(lambda: len(seen) >= grown + 6)  # the baseline: steps at the grown size
    finally:
        done.set()
        for agent in agents.values():
            if agent.poll() is None:
                kill(agent)
    steps = sorted(r["iteration_time_s"] for _, r in seen[grown + 1:])
    iteration = steps[len(steps) // 2]
    join_first, join_stall = seen[grown][0] - joined, seen[grown][0] - seen[grown - 1][0]
    iterations = [r["iteration"] for _, r in seen]
    return {"nproc_per_node": nproc, "world_size": f"{2 * nproc} -> {nproc} -> {2 * nproc}",
            "detect_s": round(detected - killed, 2), "loaded_s": round(loaded - killed, 2),
            "first_s": round(first - killed, 2), "join_first_s": round(join_first, 2),
            "join_stall_s": round(join_stall, 2), "iteration_s": round(iteration, 3),
            "first_over_iteration": round((first - killed) / iteration, 1),
            "join_stall_over_iteration": round(join_stall / iteration, 1),
            "no_iteration_lost": sorted(set(iterations)) == list(range(1, max(iterations) + 1))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    results = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            results.append(measure(Path(tmp), args.nproc_per_node))
    for r in results:
        print(json.dumps(r) if args.json else
              f"world size {r['world_size']}: node lost -> failure seen {r['detect_s']} s, checkpoint resharded "
              f"and loaded {r['loaded_s']} s, first new iteration {r['first_s']} s "
              f"({r['first_over_iteration']}x an iteration of {r['iteration_s']} s); node joined -> first "
              f"iteration at the grown size {r['join_first_s']} s, training stalled {r['join_stall_s']} s "
              f"({r['join_stall_over_iteration']}x an iteration); no iteration lost: {r['no_iteration_lost']}")

if __name__ == "__main__":
    main()
