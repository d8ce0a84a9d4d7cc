"""Stall per checkpoint save with and without ``--async-save`` for a ~100M-parameter GPT on the CPU.

    python benchmarks/checkpoint.py [--json]

Trains one process for 5 iterations, saving after iterations 2 and 4, once with inline saves and once
with ``--async-save``, and reads each save's ``checkpoint_stall_s`` (the loop's wait; reported in the next
iteration's metrics record), the iteration times around it and the background write time printed by the
commit. Model: 14 layers, h=768, 12 heads, s=64, byte vocabulary (padded to 384): 99.5M parameters;
a checkpoint holds weights and both Adam moments (fp32), about 1.2 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = ["--num-layers", "14", "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "64",
         "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "5", "--lr", "1e-4",
         "--lr-warmup-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
         "--save-interval", "2"]


def run(tmp: Path, async_save: bool) -> dict:
    metrics = tmp / f"metrics-{async_save}.jsonl"
    cmd = [sys.executable, "-m", "ptdp", "train", *MODEL, "--save", str(tmp / f"ckpt-{async_save}"),
           "--metrics-file", str(metrics), *(["--async-save"] if async_save else [])]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    writes = [float(x) for x in re.findall(r"written in ([0-9.]+) s", out)]
    return {
        "async_save": async_save,
        "stall_s": [r["checkpoint_stall_s"] for r in records if r["checkpoint_stall_s"] is not None],
        "iteration_time_s": [round(r["iteration_time_s"], 3) for r in records],
        "write_s": writes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(Path(tmp), False), run(Path(tmp), True)]
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for r in results:
        print(f"async_save={r['async_save']}: stall per save {r['stall_s']} s, background/inline write "
              f"{r['write_s']} s, iteration times {r['iteration_time_s']} s")


if __name__ == "__main__":
    main()
