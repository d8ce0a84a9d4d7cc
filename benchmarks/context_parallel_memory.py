"""Peak activation memory per rank against the sequence length under context parallelism.

Each case trains one iteration of a small GPT with ``ptdp train`` on c real CPU processes (t = p = d = 1,
``--context-parallel-size c``) and reads ``peak_activation_bytes``: the bytes autograd saved for
backward (saved-tensor hooks in the pipeline executor) at their peak, on the worst rank. Every
activation of a CP rank is over its s/c tokens (the attention kernels keep O(s/c) per rank too), so the
claim checked is ``peak(s, c) ≈ peak(s, 1) / c`` (``ratio_to_ideal`` = measured / (peak(s, 1) / c),
within 15%), and that the longest s fitting a fixed per-process budget grows ~c×: the budget is the
c = 1 peak at ``--budget-seq`` tokens, and ``longest_fitting_seq`` the longest swept s whose peak fits.

    python benchmarks/context_parallel_memory.py            # table
    python benchmarks/context_parallel_memory.py --json     # one JSON object
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
TRAIN = ["--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--lr-warmup-iters", "0",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1"]


def measure(seq: int, c: int, comm: str, workdir: Path) -> int:
    """Worst-rank peak saved activation bytes of one iteration at sequence length ``seq`` over ``c`` ranks."""
    metrics = workdir / f"s{seq}-c{c}.jsonl"
    launch = ["--nproc-per-node", str(c)] if c > 1 else []
    command = [sys.executable, "-m", "ptdp", "train", *MODEL, *TRAIN, "--seq-length", str(seq),
               "--context-parallel-size", str(c), "--cp-comm-type", comm, *launch, "--metrics-file", str(metrics)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    return int(json.loads(metrics.read_text().splitlines()[-1])["peak_activation_bytes"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--seqs", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--cp-comm-type", default="p2p", choices=["p2p", "a2a", "allgather"])
    parser.add_argument("--budget-seq", type=int, default=512, help="the budget is c=1's peak at this s")
    args = parser.parse_args(argv)
    peaks: dict[int, dict[int, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for c in args.cps:
            peaks[c] = {s: measure(s, c, args.cp_comm_type, Path(tmp)) for s in args.seqs}
    base = peaks[1]
    rows = [{"seq_length": s, "c": c, "peak_activation_bytes": peaks[c][s],
             "ratio_to_ideal": peaks[c][s] / (base[s] / c)} for c in args.cps for s in args.seqs]
    budget = base[args.budget_seq]
    longest = {c: max((s for s in args.seqs if peaks[c][s] <= budget), default=None) for c in args.cps}
    result = {"rows": rows, "budget_bytes": budget, "longest_fitting_seq": longest,
              "comm_type": args.cp_comm_type}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{'s':>6} {'c':>3} {'peak MiB':>10} {'/ (c=1 peak / c)':>18}")
    for r in rows:
        print(f"{r['seq_length']:>6} {r['c']:>3} {r['peak_activation_bytes'] / 2**20:>10.2f} "
              f"{r['ratio_to_ideal']:>18.3f}")
    print(f"budget {budget / 2**20:.2f} MiB (c=1 at s={args.budget_seq}): longest s that fits "
          + ", ".join(f"c={c}: {s}" for c, s in longest.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
