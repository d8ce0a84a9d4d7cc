"""Vocabulary parallelism: iteration time, rank balance and memory balance against the baseline.

GPT, h=256, 8 layers, p=4 on 4 CPU processes (1F1B), for each vocabulary size V in one run:

* ``baseline``: the embedding on the first stage, the output layer and the loss on the last;
* ``layout``: the best uneven layout of ``benchmarks/layouts.py`` (Megatron's ``--pipeline-model-parallel-
  layout``), no transformer layer on the last stage;
* ``vocab-1`` / ``vocab-2``: ``--enable-vocab-parallel`` with one barrier, and two (``--disable-fb-fusion``).

Per variant: the median iteration time (iterations after the first) and the baseline's over it (the
speed-up), the slowest rank's compute time over the median rank's (``step_time_max_over_median``: the
ranks' busy time in the schedule), and the peak resident memory per rank, max over min.

    python benchmarks/vocab.py                      # V = 32k, 64k, 128k
    python benchmarks/vocab.py --vocab 65536 --json
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

MODEL = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
         "--micro-batch-size", "1", "--global-batch-size", "8", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--lr-warmup-iters", "1", "--log-interval", "1"]
P = 4
VARIANTS = {
    "baseline": [],
    "vocab-1": ["--enable-vocab-parallel"],
    "vocab-2": ["--enable-vocab-parallel", "--disable-fb-fusion"],
}
# The uneven layout found fastest at V = 64k (benchmarks/layouts.py, BENCHMARKS.md):
# no transformer layer on the last stage, which keeps the output layer and the loss.
LAYOUT = "Ett|ttt|ttt|L"


def has_layout_flags() -> bool:
    from ptdp.config.schema import ParallelConfig

    return "pipeline_model_parallel_layout" in ParallelConfig.__dataclass_fields__


def run(flags: list[str], vocab: int, iters: int, workdir: Path) -> dict:
    metrics = workdir / f"metrics-{os.urandom(4).hex()}.jsonl"
    cmd = [sys.executable, "-m", "ptdp", "train", *MODEL, "--vocab-size", str(vocab), "--train-iters", str(iters),
           "--pipeline-model-parallel-size", str(P), "--nproc-per-node", str(P), "--metrics-file", str(metrics),
           *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise SystemExit(f"vocab.py: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    later = records[1:] or records
    resident = next((r["peak_resident_bytes_per_rank"] for r in reversed(records)
                     if "peak_resident_bytes_per_rank" in r), None)
    return {
        "iteration_time_s": statistics.median(r["iteration_time_s"] for r in later),
        "slowest_over_median": statistics.median(r.get("step_time_max_over_median", float("nan")) for r in later),
        "peak_resident_mb_per_rank": [round(b / 2**20) for b in resident] if resident else None,
        "memory_max_over_min": round(max(resident) / min(resident), 3) if resident else None,
        "loss": records[-1]["loss"],
    }


def measure(vocab: int, iters: int, workdir: Path) -> dict:
    out = {name: run(flags, vocab, iters, workdir) for name, flags in VARIANTS.items()}
    if has_layout_flags():
        out["layout"] = {**run(["--pipeline-model-parallel-layout", LAYOUT], vocab, iters, workdir), "flags": LAYOUT}
    base = out["baseline"]["iteration_time_s"]
    for r in out.values():
        r["speedup_over_baseline"] = round(base / r["iteration_time_s"], 3)
        r["iteration_time_s"] = round(r["iteration_time_s"], 4)
        r["slowest_over_median"] = round(r["slowest_over_median"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--iters", type=int, default=4, help="iterations per run (the first is not timed)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for vocab in args.vocab:
            results[vocab] = measure(vocab, args.iters, Path(tmp))
            if not args.json:
                print(f"V={vocab}: GPT h=256, 8 layers, s=128, b=1, m=8, p={P} (1f1b), {P} CPU processes")
                print(f"  {'variant':10s} {'iter s':>8s} {'speed-up':>9s} {'slowest/median':>15s} "
                      f"{'mem max/min':>12s}  peak MB per rank")
                for name, r in results[vocab].items():
                    print(f"  {name:10s} {r['iteration_time_s']:8.3f} {r['speedup_over_baseline']:9.2f} "
                          f"{r['slowest_over_median']:15.2f} {r['memory_max_over_min'] or float('nan'):12.2f}  "
                          f"{r['peak_resident_mb_per_rank']} {r.get('flags', '')}", flush=True)
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
