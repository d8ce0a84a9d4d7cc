"""Vocabulary parallelism on a Gemma-shaped output layer: V = 262,144 (Gemma 3's vocabulary), p = 4.

A Gemma 3 model (``--model tiny-gemma3``: GeGLU, sandwich norms, (1 + w) norms, windows with every third layer
global; tied embedding) widened to h = 64 so that the output layer dominates as it does in Gemma 3 1B (its
262k x 1152 embedding is ~300M of its 1B parameters), 8 layers, s = 64, m = 8, on 4 CPU processes (1F1B),
trained twice through ``benchmarks/vocab.py``'s runner: the even split (embedding on rank 0, the output layer
and the loss on rank 3) and ``--enable-vocab-parallel`` (both spread over the 4 ranks, one barrier). Per
variant: the median iteration time, the slowest rank's compute time over the median rank's
(``step_time_max_over_median``), the peak resident memory per rank; both end at the same loss.

    python benchmarks/vocab_gemma.py              # about 10 min on a loaded 2-core machine
    python benchmarks/vocab_gemma.py --json --iters 3
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vocab  # noqa: E402  (benchmarks/vocab.py: its runner, with this model)

V = 262_144
MODEL = ["--model", "tiny-gemma3", "--hidden-size", "64", "--kv-channels", "16", "--ffn-hidden-size", "128",
         "--seq-length", "64", "--window-size", "16", "--micro-batch-size", "1", "--global-batch-size", "8",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--lr-warmup-iters", "1", "--log-interval", "1"]
VARIANTS = {"baseline": [], "vocab-parallel": ["--enable-vocab-parallel"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=3, help="iterations per run (the first is not timed)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    vocab.MODEL = MODEL
    with tempfile.TemporaryDirectory() as tmp:
        out = {name: vocab.run(flags, V, args.iters, Path(tmp)) for name, flags in VARIANTS.items()}
    base = out["baseline"]
    for r in out.values():
        r["speedup_over_baseline"] = round(base["iteration_time_s"] / r["iteration_time_s"], 3)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"V={V}: Gemma 3 (tiny-gemma3, h=64), 8 layers, s=64, b=1, m=8, p={vocab.P} (1f1b), {vocab.P} CPU processes")
    print(f"  {'variant':15s} {'iter s':>8s} {'speed-up':>9s} {'slowest/median':>15s} {'mem max/min':>12s}  "
          "peak MB per rank  loss")
    for name, r in out.items():
        print(f"  {name:15s} {r['iteration_time_s']:8.3f} {r['speedup_over_baseline']:9.2f} "
              f"{r['slowest_over_median']:15.2f} {r['memory_max_over_min'] or float('nan'):12.2f}  "
              f"{r['peak_resident_mb_per_rank']}  {r['loss']:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
