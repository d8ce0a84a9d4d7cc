"""Time from a lost node to the first new iteration after the elastic restart (scale-down).

    python benchmarks/elastic.py [--json] [--nproc-per-node 1] [--repeats 1]

Two ``ptdp train --nnodes 1:2`` agents (the tiny test model, p = 1, d = 2 x nproc, a checkpoint every
iteration) meet through a c10d rendezvous this script hosts; once iteration 2 is saved, one agent and its
workers are SIGKILLed. Printed, from the kill: ``detect_s`` until the survivor's agent stops its failed
workers, ``loaded_s`` until the restarted workers have loaded the resharded checkpoint, and ``first_s``
until the first iteration at the new size is logged. The rendezvous options are the test's
(``last_call_timeout=1``, dead node after 5 missed 1-s heartbeats): the restart waits for the dead node's
heartbeats to expire, so ``keep_alive_interval x keep_alive_max_attempt`` is a floor under ``loaded_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
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
    children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children")
    workers = [int(pid) for pid in children.read_text().split()] if children.exists() else []
    for group in (agent.pid, *workers):
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    agent.wait()


def measure(tmp: Path, nproc: int) -> dict:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    ckpt, metrics = tmp / "ckpt", tmp / "metrics.jsonl"
    args = ["train", *TINY, "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "1",
            "--metrics-file", str(metrics), "--nnodes", "1:2", "--nproc-per-node", str(nproc),
            "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-id", "bench", "--rdzv-conf", RDZV_CONF,
            "--monitor-interval", "0.1", "--max-restarts", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PTDP_TEST_SLOW_RANK": "*:0.2"}
    logs = {name: tmp / f"{name}.log" for name in "ab"}
    agents = {name: subprocess.Popen([sys.executable, "-m", "ptdp", *args], stdout=logs[name].open("w"),
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True) for name in "ab"}
    try:
        wait(lambda: (ckpt / "iter_0000002").exists())
        kill(agents["b"])
        killed = time.monotonic()
        detected = wait(lambda: "closing signal SIGTERM" in logs["a"].read_text())
        loaded = wait(lambda: "resharded the checkpoint" in logs["a"].read_text())
        resumed = int(logs["a"].read_text().split("resharded the checkpoint")[0].rsplit("at iteration ", 1)[1].split()[0])
        lines = len(metrics.read_text().splitlines())
        first = wait(lambda: len(metrics.read_text().splitlines()) > lines
                     and json.loads(metrics.read_text().splitlines()[-1])["iteration"] == resumed + 1)
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                kill(agent)
    return {"nproc_per_node": nproc, "world_size": f"{2 * nproc} -> {nproc}", "resumed_from": resumed,
            "detect_s": round(detected - killed, 2), "loaded_s": round(loaded - killed, 2),
            "first_s": round(first - killed, 2)}


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
              f"world size {r['world_size']}: failure seen {r['detect_s']} s after the kill, checkpoint "
              f"(iteration {r['resumed_from']}) resharded and loaded at {r['loaded_s']} s, first new iteration "
              f"logged at {r['first_s']} s")


if __name__ == "__main__":
    main()
