"""Multi-token prediction under vocabulary parallelism: rank balance and iteration time.

A DeepSeek-style dense model (MLA, RMSNorm, SwiGLU, untied output), h=256, 8 layers, s=128, V=64k, with 2 MTP
modules, p=4 on 4 CPU processes (1F1B), in one run:

* ``baseline``: the embedding on the first stage; the output layer, the loss and the 2 MTP modules with
  their own output projections and losses (1 + 2 vocabulary layers) on the last;
* ``vocab-1`` / ``vocab-2``: ``--enable-vocab-parallel`` (one barrier, and two with
  ``--disable-fb-fusion``): the MTP modules' heads split over the 4 stages as S/T passes like the main head's.

Per variant: the median iteration time (iterations after the first) and the baseline's over it, and the
slowest rank's compute time over the median rank's (``step_time_max_over_median``, the goal <= 1.15 with
vocabulary parallelism). The same numbers without MTP are printed beside them for scale.

    python benchmarks/deepseek_mtp.py
    python benchmarks/deepseek_mtp.py --vocab 65536 --mtp 2 --json
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
         "--ffn-hidden-size", "704", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--multi-latent-attention",
         "--q-lora-rank", "64", "--kv-lora-rank", "64", "--qk-head-dim", "32", "--qk-pos-emb-head-dim", "16",
         "--v-head-dim", "32", "--micro-batch-size", "1", "--global-batch-size", "8", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--lr-warmup-iters", "1", "--log-interval", "1"]
P = 4
VARIANTS = {
    "baseline": [],
    "vocab-1": ["--enable-vocab-parallel"],
    "vocab-2": ["--enable-vocab-parallel", "--disable-fb-fusion"],
}


def run(flags: list[str], vocab: int, mtp: int, iters: int, workdir: Path) -> dict:
    metrics = workdir / f"metrics-{os.urandom(4).hex()}.jsonl"
    cmd = [sys.executable, "-m", "ptdp", "train", *MODEL, "--vocab-size", str(vocab), "--mtp-num-layers", str(mtp),
           "--train-iters", str(iters), "--pipeline-model-parallel-size", str(P), "--nproc-per-node", str(P),
           "--metrics-file", str(metrics), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise SystemExit(f"deepseek_mtp.py: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    later = records[1:] or records
    return {
        "iteration_time_s": round(statistics.median(r["iteration_time_s"] for r in later), 4),
        "slowest_over_median": round(statistics.median(r["step_time_max_over_median"] for r in later), 3),
        "loss": records[-1]["loss"],
        **({"mtp_loss": records[-1]["mtp_loss"]} if mtp else {}),
    }


def measure(vocab: int, mtp: int, iters: int, workdir: Path) -> dict:
    out = {name: run(flags, vocab, mtp, iters, workdir) for name, flags in VARIANTS.items()}
    base = out["baseline"]["iteration_time_s"]
    for r in out.values():
        r["speedup_over_baseline"] = round(base / r["iteration_time_s"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--mtp", type=int, default=2, help="--mtp-num-layers")
    parser.add_argument("--iters", type=int, default=4, help="iterations per run (the first is not timed)")
    parser.add_argument("--no-reference", action="store_true", help="skip the runs without MTP")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = {f"mtp={args.mtp}": measure(args.vocab, args.mtp, args.iters, Path(tmp))}
        if not args.no_reference:
            results["mtp=0"] = measure(args.vocab, 0, args.iters, Path(tmp))
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"V={args.vocab}: MLA h=256, 8 layers, s=128, b=1, m=8, p={P} (1f1b), {P} CPU processes")
    for key, rows in results.items():
        print(f"  {key}: {'variant':10s} {'iter s':>8s} {'speed-up':>9s} {'slowest/median':>15s}")
        for name, r in rows.items():
            print(f"  {'':{len(key)}s}  {name:10s} {r['iteration_time_s']:8.3f} {r['speedup_over_baseline']:9.2f} "
                  f"{r['slowest_over_median']:15.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
