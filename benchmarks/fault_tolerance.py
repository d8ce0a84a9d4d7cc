"""Fault-tolerant replica groups against the checkpoint-restart path: time lost per failure, and the
per-step cost of the quorum with no failure.

    PYTHONPATH=. python benchmarks/fault_tolerance.py [--json] [--iters 100] [--kill-at 5] [--step-delay 0.2]

The tiny test model, (t, p) = (1, 2), 4 workers, each batch load of every rank delayed by ``--step-delay``
seconds (tests/faults' ``PTDP_TEST_SLOW_RANK``: a group alone, training both shares, waits twice), so
that a step lasts long enough for a restart to have something to rejoin; four runs of ``ptdp train``:

* ``plain``: one job, d = 2 (the baseline of the per-step cost);
* ``replicas``: ``--fault-tolerant-replicas 2``, two groups of (1, 2), no failure;
* ``replicas_kill``: the same, with rank 1 of group 1 SIGKILLed at the start of iteration ``--kill-at``
  (tests/faults' ``PTDP_TEST_KILL_AT_ITERATION``, once); torchrun restarts that group, which rejoins from a
  live peer;
* ``restart_kill``: the plain job with the same kill (the last rank), ``--max-restarts 1`` and a
  checkpoint every iteration (``--save DIR --load DIR --save-interval 1``, the best case of that path):
  every worker restarts and loads the latest checkpoint.

Printed: each run's wall time and median iteration; the quorum's time per step (``quorum_s`` in the
metrics); for the failure runs the time lost (wall time minus the failure-free run's); for replicas_kill
the survivor's slowest iteration against its median, the rejoin time (from the kill to the restarted
group's first committed step, polled from its metrics file), whether both groups end with the same weights
as the failure-free run, and whether every global batch's samples were trained exactly once (the metrics'
``sample_ranges`` of both groups against ``ptdp samples --iteration``). An iteration of this model is far
shorter than a process start, so the times lost are dominated by start-up (Python, torch, the groups).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAULTS = ROOT / "tests" / "faults"
TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "1e-3", "--lr-warmup-iters", "1",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
        "--pipeline-model-parallel-size", "2", "--nproc-per-node", "4"]
REPLICAS = ["--fault-tolerant-replicas", "2", "--fault-tolerant-timeout-s", "120"]


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def train(out: Path, name: str, iters: int, extra: list[str], env: dict[str, str] | None = None,
          watch: Path | None = None, after: int = 0) -> dict:
    """Run ``ptdp train``; its wall time, metrics path and checkpoint; with ``watch``, the time the first
    record of an iteration above ``after`` appeared there after a record at or below it (a rejoin)."""
    run = out / name
    run.mkdir(parents=True)
    metrics, ckpt = run / "m.jsonl", run / "ck"
    command = [sys.executable, "-m", "ptdp", "train", *TINY, "--train-iters", str(iters), *extra,
               "--metrics-file", str(metrics), "--save", str(ckpt)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join([str(FAULTS), str(ROOT)]), **(env or {})}
    seen: dict[str, float] = {}
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set() and watch is not None:
            rows = records(run / watch) if (run / watch).exists() else []
            if any(r["iteration"] > after for r in rows) and "rejoined" not in seen:
                seen["rejoined"] = time.time()
            time.sleep(0.05)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    start = time.perf_counter()
    log = (run / "log").open("w")
    proc = subprocess.run(command, env=full_env, stdout=log, stderr=subprocess.STDOUT, timeout=1800)
    wall = time.perf_counter() - start
    stop.set()
    if proc.returncode:
        raise SystemExit(f"{name} failed ({proc.returncode}); see {run / 'log'}")
    return {"wall_s": wall, "metrics": metrics, "ckpt": ckpt, "run": run, **seen}


def median_iteration(rows: list[dict]) -> float:
    return statistics.median(r["iteration_time_s"] for r in rows)


def weights_difference(a: Path, b: Path) -> float:
    """The largest per-tensor ``|a - b| / |b|`` (norms) between two checkpoints' full models."""
    from ptdp.checkpointing import read_full_model_state

    wa, wb = read_full_model_state(a)[0], read_full_model_state(b)[0]
    assert wa.keys() == wb.keys()
    return max(float((wa[k].double() - wb[k].double()).norm() / wb[k].double().norm().clamp(min=1e-30))
               for k in wa)


def trained_once(groups: list[list[dict]], iters: int, flags: list[str]) -> bool:
    """Every global batch 1..iters was committed, by as many groups as its quorum size; the ranges those
    groups trained add up to the batch without overlap, and are ``ptdp samples --iteration`` of it."""
    steps: dict[int, list[dict]] = {}
    for rows in groups:
        its = [r["iteration"] for r in rows]
        if len(its) != len(set(its)):  # a group committed an iteration twice
            return False
        for r in rows:
            steps.setdefault(r["iteration"], []).append(r)
    if sorted(steps) != list(range(1, iters + 1)):
        return False
    trained: dict[int, list[int]] = {}
    for it, rows in steps.items():
        if any(r["quorum_size"] != len(rows) for r in rows):
            return False
        trained[it] = [i for r in rows for lo, hi in r["sample_ranges"] for i in range(lo, hi)]
    out = subprocess.run([sys.executable, "-m", "ptdp", "samples", *flags, "--start", "0", "--first",
                          str(iters * 16)], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    want: dict[int, list[int]] = {}
    for line in out.stdout.splitlines():
        record = json.loads(line)
        want.setdefault(record["iteration"], []).append(record["sample"])
    for it in range(1, iters + 1):
        if sorted(trained[it]) != sorted(want[it]):  # sorted: a sample trained twice would appear twice
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--step-delay", type=float, default=0.2)
    parser.add_argument("--kill-at", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    # a step of a real model is far longer than the tiny one's: each share's batch load sleeps --step-delay
    slow = {"PTDP_TEST_SLOW_RANK": f"*:{args.step_delay}"} if args.step_delay else {}
    kill = {**slow, "PTDP_TEST_KILL_AT_ITERATION": str(args.kill_at)}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        plain = train(out, "plain", args.iters, [], env=slow)
        replicas = train(out, "replicas", args.iters, REPLICAS, env=slow)
        killed = train(out, "replicas_kill", args.iters, REPLICAS,
                       env={**kill, "PTDP_TEST_KILL_REPLICA_GROUP": "1"}, watch=Path("m-replica1.jsonl"),
                       after=args.kill_at)
        restart = train(out, "restart_kill", args.iters,
                        ["--max-restarts", "1", "--load", str(out / "restart_kill" / "ck"), "--save-interval", "1"],
                        env=kill)
        marker = next(killed["run"].glob(".test-killed-*"))
        g0, g1 = records(killed["metrics"]), records(killed["run"] / "m-replica1.jsonl")
        # wall time between commits: the failed attempt and the quorums around the failure included
        times = [r["commit_interval_s"] for r in g0[1:]]
        around = [r["commit_interval_s"] for r in g0 if abs(r["iteration"] - args.kill_at) <= 2]
        result = {
            "iters": args.iters, "kill_at": args.kill_at,
            "plain_iteration_s": median_iteration(records(plain["metrics"])),
            "replicas_iteration_s": median_iteration(records(replicas["metrics"])),
            "replicas_quorum_s": statistics.median(r["quorum_s"] for r in records(replicas["metrics"])),
            "plain_wall_s": plain["wall_s"], "replicas_wall_s": replicas["wall_s"],
            "replicas_kill_wall_s": killed["wall_s"], "restart_kill_wall_s": restart["wall_s"],
            "replicas_lost_s": killed["wall_s"] - replicas["wall_s"],
            "restart_lost_s": restart["wall_s"] - plain["wall_s"],
            "survivor_median_s": statistics.median(times), "survivor_slowest_near_kill_s": max(around),
            "survivor_slowest_s": max(times),
            "rejoin_s": killed.get("rejoined", float("nan")) - marker.stat().st_mtime,
            "rejoined_at": min((r["iteration"] for r in g1 if r["iteration"] > args.kill_at), default=None),
            "quorum_sizes": [r["quorum_size"] for r in g0],
            "group0_vs_group1_weights": weights_difference(Path(str(killed["ckpt"]) + "-replica1"), killed["ckpt"]),
            "failure_vs_failure_free_weights": weights_difference(killed["ckpt"], replicas["ckpt"]),
            "replicas_first_quorum_s": records(replicas["metrics"])[0]["quorum_s"],
            "samples_once": trained_once([g0, g1], args.iters, [*TINY, *REPLICAS, "--train-iters", str(args.iters)]),
        }
    result["survivor_slowest_ratio"] = result["survivor_slowest_near_kill_s"] / result["survivor_median_s"]
    result["quorum_step_ratio"] = result["replicas_iteration_s"] / result["plain_iteration_s"]
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:32s} {value:.4g}" if isinstance(value, float) else f"{key:32s} {value}")
    # the contract, checked: the run went on, group 1 came back, every sample once, the same model
    problems = [what for what, bad in (
        ("group 1 did not rejoin", result["rejoined_at"] is None),
        ("a global batch was not trained exactly once", not result["samples_once"]),
        ("the groups' weights differ", result["group0_vs_group1_weights"] > 1e-6),
        ("the weights differ from the failure-free run's", result["failure_vs_failure_free_weights"] > 1e-3),
    ) if bad]
    if problems:
        raise SystemExit("; ".join(problems))


if __name__ == "__main__":
    main()
