"""Megatron's uneven pipeline layouts against the even split at a large vocabulary.

GPT (h=256, 8 layers, V=65,536 by default), p=4 on 4 CPU processes (gloo), 1F1B, each variant one
``python -m ptdp train`` run of a few iterations, all in one invocation: the even split (the baseline),
then each ``--pipeline-model-parallel-layout`` given. Per variant, from the metrics of the iterations after
the first: the median iteration time relative to the baseline's, the slowest rank's step time over the
median rank's (``step_time_max_over_median``), and the peak resident memory per rank (max over min).

    python benchmarks/layouts.py --json
    python benchmarks/layouts.py --vocab-size 131072 --layouts "Ettt|ttt|tt|L" "Ett|ttt|ttt|L"
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

LAYOUTS = ["Ettt|ttt|tt|L", "Ett|ttt|ttt|L", "Ettt|tt|tt|tL"]


def run(shape: list[str], layout: str | None, iters: int, tmp: Path) -> dict:
    metrics = tmp / f"m-{os.urandom(4).hex()}.jsonl"
    cmd = [sys.executable, "-m", "ptdp", "train", *shape, "--train-iters", str(iters), "--log-interval", "1",
           "--pipeline-model-parallel-size", "4", "--nproc-per-node", "4", "--metrics-file", str(metrics)]
    if layout:
        cmd += ["--pipeline-model-parallel-layout", layout]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()][1:]  # the first warms up
    memory = records[-1]["peak_resident_bytes_per_rank"]
    return {
        "layout": layout or "even",
        "iteration_time_s": statistics.median(r["iteration_time_s"] for r in records),
        "slowest_over_median": statistics.median(r["step_time_max_over_median"] for r in records),
        "slowest_rank": records[-1]["slowest_rank"],
        "peak_resident_gb_per_rank": [round(b / 1e9, 3) for b in memory],
        "memory_max_over_min": max(memory) / min(memory),
        "final_loss": records[-1]["loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab-size", type=int, default=65536)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--layouts", nargs="*", default=LAYOUTS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    shape = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length",
             str(args.seq_length), "--vocab-size", str(args.vocab_size), "--micro-batch-size",
             str(args.micro_batch_size), "--global-batch-size", str(args.micro_batch_size * args.microbatches),
             "--hidden-dropout", "0", "--attention-dropout", "0"]
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(shape, layout, args.iters, Path(tmp)) for layout in [None, *args.layouts]]
    base = rows[0]["iteration_time_s"]
    for row in rows:
        row["time_vs_even"] = row["iteration_time_s"] / base
        row["throughput_vs_even"] = base / row["iteration_time_s"]
    if args.json:
        print(json.dumps({"vocab_size": args.vocab_size, "p": 4, "variants": rows}, indent=1))
        return
    print(f"V={args.vocab_size} p=4 (8 layers, h=256, s={args.seq_length}, b={args.micro_batch_size}, "
          f"m={args.microbatches}), 1f1b on 4 CPU processes")
    for r in rows:
        print(f"{r['layout']:>16}  iteration {r['iteration_time_s']:.3f} s ({r['time_vs_even']:.2f}x even)  "
              f"slowest/median {r['slowest_over_median']:.2f} (rank {r['slowest_rank']})  "
              f"memory max/min {r['memory_max_over_min']:.2f}  GB/rank {r['peak_resident_gb_per_rank']}")


if __name__ == "__main__":
    main()
