"""Iteration time of a real GPT under each pipeline schedule: `ptdp train` on CPU processes (gloo), p = 4.

    python benchmarks/pipeline_gpt.py --json
    python benchmarks/pipeline_gpt.py --schedules 1f1b interleaved zb-h1 zbv --iters 8

Every schedule trains the same model on the same batches (the losses are printed and must agree to fp32
tolerance); the result per schedule is the median ``iteration_time_s`` of the iterations after the first
two (warm-up), the measured bubble (idle over busy time of the pipeline executor, max over ranks) beside
the schedule's formula, and ``time_over_1f1b``. With p processes on fewer cores the ranks also compete for
the cores, so the bubble a schedule removes is only partly turned into speed here: the synthetic
benchmark (benchmarks/schedules.py) isolates the schedule itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SCHEDULE_FLAGS = {
    "1f1b": [],
    "interleaved": ["--virtual-pipeline-model-parallel-size", "2"],
    "zb-h1": [],
    "zb-h2": [],
    "zbv": [],
    "v-half": [],
    "v-min": [],
}


def run(schedule: str, args: argparse.Namespace, workdir: Path) -> dict:
    metrics = workdir / f"{schedule}.jsonl"
    command = [
        sys.executable, "-m", "ptdp", "train", "--nproc-per-node", str(args.p),
        "--pipeline-model-parallel-size", str(args.p), "--pipeline-schedule", schedule,
        *SCHEDULE_FLAGS[schedule],
        "--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--num-attention-heads", "8",
        "--seq-length", str(args.seq), "--micro-batch-size", "1", "--global-batch-size", str(args.m),
        "--train-iters", str(args.iters), "--lr", "1e-4", "--lr-warmup-iters", "0",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
        "--metrics-file", str(metrics),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{schedule} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steady = records[2:] or records
    return {
        "iteration_time_s": statistics.median(r["iteration_time_s"] for r in steady),
        "bubble_fraction": statistics.median(r["bubble_fraction"] for r in steady),
        "bubble_fraction_formula": records[-1]["bubble_fraction_formula"],
        "peak_activation_bytes": records[-1]["peak_activation_bytes"],
        "losses": [r["loss"] for r in records],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "interleaved", "zb-h1", "zbv"],
                        choices=list(SCHEDULE_FLAGS))
    parser.add_argument("--p", type=int, default=4)
    parser.add_argument("--m", type=int, default=8, help="microbatches (global batch, micro-batch 1)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run(name, args, Path(tmp)) for name in args.schedules}
    base = results.get("1f1b")
    for r in results.values():
        r["time_over_1f1b"] = r["iteration_time_s"] / base["iteration_time_s"] if base else None
    reference = next(iter(results.values()))["losses"]
    worst = max(abs(a - b) / abs(b) for r in results.values() for a, b in zip(r["losses"], reference))
    out = {"p": args.p, "m": args.m, "layers": args.layers, "hidden": args.hidden, "seq": args.seq,
           "cpus": os.cpu_count(), "max_relative_loss_difference": worst, "schedules": results}
    if args.json:
        print(json.dumps(out))
        return
    print(f"GPT {args.layers} layers, h={args.hidden}, s={args.seq}, p={args.p}, m={args.m}, {os.cpu_count()} CPUs; "
          f"losses agree to {worst:.1e}")
    print(f"{'schedule':12s} {'s/iter':>8s} {'vs 1f1b':>8s} {'bubble':>8s} {'formula':>8s} {'act MB':>8s}")
    for name, r in results.items():
        ratio = f"{r['time_over_1f1b']:.3f}" if r["time_over_1f1b"] else "-"
        print(f"{name:12s} {r['iteration_time_s']:8.3f} {ratio:>8s} {r['bubble_fraction']:8.3f} "
              f"{r['bubble_fraction_formula']:8.3f} {r['peak_activation_bytes'] / 2**20:8.1f}")


if __name__ == "__main__":
    main()
