"""Threads of a one-process run: ``ptdp train`` (the README's model, one process) on an idle machine and on one
busy with other work, under torch's OpenMP (libgomp) wait settings.

    python benchmarks/threads.py                  # idle, then with 2 busy processes per core beside it
    python benchmarks/threads.py --iters 20 --load 1

Each setting runs ``ptdp train`` as a user would (``python -m ptdp train ...``) and reads its mean iteration
time after the first (which pays one-off costs) from the metrics file. The settings: ``default`` (libgomp's:
a waiting thread spins 300,000 times before it sleeps; what ptdp ran with before), ``spin-10k``
(``GOMP_SPINCOUNT=10000``: what ``ptdp`` sets now unless the user set a wait policy), ``spin-100k``,
``passive`` (``OMP_WAIT_POLICY=PASSIVE``: sleep at once) and ``one-thread`` (``OMP_NUM_THREADS=1``). Ratios
are against ``default`` in the same condition; the busy load is plain Python loops in other processes
(``--load`` per core), started before and stopped after each condition's runs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = {"default": {"GOMP_SPINCOUNT": "300000"}, "spin-10k": {"GOMP_SPINCOUNT": "10000"},
            "spin-100k": {"GOMP_SPINCOUNT": "100000"}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
            "one-thread": {"OMP_NUM_THREADS": "1"}}


def _burn(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def _run(setting: str, iters: int) -> float:
    """Mean iteration time (ms) of ``ptdp train`` after its first iteration."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        env["OMP_WAIT_POLICY"] = ""  # not what ptdp sets: each setting says its own (empty: libgomp's default)
        env.update(SETTINGS[setting])
        subprocess.run([sys.executable, "-m", "ptdp", "train", "--train-iters", str(iters), "--lr", "1e-3",
                        "--log-interval", str(iters), "--metrics-file", str(metrics)],
                       env=env, check=True, capture_output=True, timeout=3600)
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        return 1000 * statistics.mean(r["iteration_time_s"] for r in records[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--load", type=int, default=2, help="busy processes per core in the busy condition")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    print(f"ptdp train, one process, {args.iters} iterations (mean after the first); {cores} cores")
    print("| condition | setting | ms / iteration | / default |")
    print("| --- | --- | --- | --- |")
    for condition, busy in (("idle", 0), (f"busy ({args.load} Python loops per core)", args.load * cores)):
        stop = multiprocessing.Event()
        burners = [multiprocessing.Process(target=_burn, args=(stop,)) for _ in range(busy)]
        for proc in burners:
            proc.start()
        time.sleep(1.0 if busy else 0.0)
        try:
            times = {setting: _run(setting, args.iters) for setting in SETTINGS}
        finally:
            stop.set()
            for proc in burners:
                proc.join()
        for setting, ms in times.items():
            print(f"| {condition} | {setting} | {ms:.1f} | {ms / times['default']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
