"""ptdp's ``train`` command against nanoGPT's own ``train.py``, two processes, its CPU recipe, every iteration logged.

    python benchmarks/nanogpt.py /tmp/nanogpt --pairs 3 --iters 200

``NANOGPT`` is a checkout of nanoGPT (its ``train.py``, ``model.py``, ``configurator.py`` and
``config/train_shakespeare_char.py``) whose ``data/shakespeare_char`` holds ``train.bin``, ``val.bin`` and
``meta.pkl`` as its ``prepare.py`` writes them. Nothing of nanoGPT is in this repository: this script only
starts it. The same characters are written for ptdp as a NullTokenizer dataset (ids as text, ``ptdp
preprocess``) in a scratch directory, once.

Both sides run nanoGPT's README CPU recipe: 4 layers, h = 128, 4 heads, s = 64, b = 12, no biases, dropout 0,
AdamW (lr 1e-3, beta2 0.99, weight decay 0.1), clip 1.0, warm-up 100 and cosine decay to 1e-4 over the run,
``--compile=False``, a log line every iteration. ptdp's vocabulary is 66 (NullTokenizer's 65 ids + its eod id)
against nanoGPT's 65. The MLP activation is the same: nanoGPT's ``nn.GELU()`` is the exact (erf) GeLU, and
so is ptdp's without linear biases (Megatron-LM's rule, docs/cli.md#gelu); ``--openai-gelu`` runs ptdp with
the tanh form instead (its only GeLU before, the slower kernel on a CPU; BENCHMARKS.md). Evaluation: nanoGPT's ``eval_interval`` and ptdp's ``--eval-interval`` are past the
run, so neither evaluates inside the timed window (nanoGPT evaluates at iteration 0, ptdp after its last).

The runs alternate (nanoGPT, ptdp, nanoGPT, ptdp, ...), ``--pairs`` pairs, each side under the same
``OMP_NUM_THREADS``. Each run is timed from its own log lines: the parent reads the child's output as it
comes and, at the line of iteration ``--warmup`` and at the line of the run's last-but-one iteration,
notes the wall clock and the CPU time of the child's process tree (``/proc``: user + system). Per pair, the
ratios ptdp / nanoGPT of the wall and CPU seconds per iteration; the result is their median (goal <= 1.00).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

TICK = os.sysconf("SC_CLK_TCK")
NANO_LINE = re.compile(r"^iter (\d+): loss")
PTDP_LINE = re.compile(r"^\s*iteration\s+(\d+)/")


def tree_cpu(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its descendants (the launcher's worker, if any)."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                text = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = text[text.rindex(")") + 2:].split()
            stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK)
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, (0, 0.0))[1]
        todo.extend(c for c, (ppid, _) in stats.items() if ppid == p)
    return total


def timed_run(cmd: list[str], cwd: str, line: re.Pattern, first: int, last: int, env: dict) -> tuple[float, float]:
    """Wall and CPU seconds per iteration between the log lines of iterations ``first`` and ``last``."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marks = {}
    tail = []
    for text in proc.stdout:
        tail = (tail + [text])[-20:]
        match = line.match(text)
        if match and int(match.group(1)) in (first, last):
            marks[int(match.group(1))] = (time.perf_counter(), tree_cpu(proc.pid))
    if proc.wait() != 0 or len(marks) != 2:
        raise SystemExit(f"nanogpt.py: {' '.join(cmd[:3])} ... failed:\n" + "".join(tail))
    n = last - first
    return (marks[last][0] - marks[first][0]) / n, (marks[last][1] - marks[first][1]) / n


def ptdp_data(nanogpt: Path, scratch: Path) -> Path:
    """nanoGPT's train.bin as a ptdp NullTokenizer dataset (eod = 65): written once into ``scratch``."""
    prefix = scratch / "chars"
    if not Path(f"{prefix}.idx").exists():
        scratch.mkdir(parents=True, exist_ok=True)
        ids = np.fromfile(nanogpt / "data/shakespeare_char/train.bin", dtype=np.uint16)
        with open(scratch / "train.jsonl", "w") as f:
            for i in range(0, len(ids), 4096):
                f.write(json.dumps({"text": " ".join(map(str, ids[i:i + 4096].tolist()))}) + "\n")
        subprocess.run([sys.executable, "-m", "ptdp.data.preprocess", "--input", str(scratch / "train.jsonl"),
                        "--output-prefix", str(prefix), "--tokenizer-type", "NullTokenizer", "--vocab-size", "65"],
                       check=True, stdout=subprocess.DEVNULL)
    return prefix


def commands(args, prefix: Path) -> tuple[list[str], list[str]]:
    n = str(args.iters)
    nano = [sys.executable, "train.py", "config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
            "--eval_iters=20", "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4",
            "--n_head=4", "--n_embd=128", f"--max_iters={n}", f"--lr_decay_iters={n}", "--dropout=0.0",
            f"--eval_interval={10 * args.iters}", "--out_dir=/tmp/nanogpt-bench-out"]
    ptdp = [sys.executable, "-m", "ptdp.cli.main", "train", "--data-path", str(prefix),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "66", "--make-vocab-size-divisible-by", "1",
            "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "12", "--global-batch-size", "12",
            "--train-iters", n, "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "100",
            "--lr-decay-style", "cosine", "--lr-decay-iters", n, "--weight-decay", "0.1", "--adam-beta2", "0.99",
            "--clip-grad", "1.0", "--hidden-dropout", "0", "--attention-dropout", "0", "--disable-bias-linear",
            "--disable-bias-norm", "--log-interval", "1", "--eval-interval", str(10 * args.iters),
            "--eval-iters", "1", *(["--openai-gelu"] if args.openai_gelu else [])]
    return nano, ptdp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("nanogpt", type=Path, help="a nanoGPT checkout with data/shakespeare_char prepared")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--iters", type=int, default=200, help="iterations per run (>= 101: the warm-up)")
    parser.add_argument("--warmup", type=int, default=20, help="the timed window starts at this iteration")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of both")
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/ptdp-nanogpt-bench"))
    parser.add_argument("--openai-gelu", action="store_true", help="ptdp with the tanh GeLU (nanoGPT's is exact)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not (args.nanogpt / "train.py").exists() or not (args.nanogpt / "data/shakespeare_char/meta.pkl").exists():
        parser.error(f"{args.nanogpt}: no train.py or data/shakespeare_char/meta.pkl (run its prepare.py)")
    if args.iters < max(101, args.warmup + 2):
        parser.error("--iters must be at least 101 (past the learning-rate warm-up) and --warmup + 2")
    repo = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    prefix = ptdp_data(args.nanogpt, args.scratch)
    nano_cmd, ptdp_cmd = commands(args, prefix)
    # nanoGPT logs "iter 0" first: its iteration k is ptdp's k + 1, so the windows cover the same steps
    first, last = args.warmup, args.iters - 1
    runs = {"nanogpt": [], "ptdp": []}
    for pair in range(args.pairs):
        runs["nanogpt"].append(timed_run(nano_cmd, str(args.nanogpt), NANO_LINE, first - 1, last - 1, env))
        runs["ptdp"].append(timed_run(ptdp_cmd, str(args.scratch), PTDP_LINE, first, last, env))
        (nw, nc), (pw, pc) = runs["nanogpt"][-1], runs["ptdp"][-1]
        print(f"pair {pair + 1}: nanoGPT {nw * 1e3:.1f} ms ({nc * 1e3:.1f} CPU)  ptdp {pw * 1e3:.1f} ms "
              f"({pc * 1e3:.1f} CPU)  wall ratio {pw / nw:.3f}  CPU ratio {pc / nc:.3f}", file=sys.stderr)
    wall = [p[0] / n[0] for n, p in zip(runs["nanogpt"], runs["ptdp"])]
    cpu = [p[1] / n[1] for n, p in zip(runs["nanogpt"], runs["ptdp"])]
    result = {"benchmark": "nanogpt", "wall_ratios": wall, "cpu_ratios": cpu,
              "median_wall_ratio": statistics.median(wall), "median_cpu_ratio": statistics.median(cpu), "goal": 1.00,
              "nanogpt_ms": [n[0] * 1e3 for n in runs["nanogpt"]], "ptdp_ms": [p[0] * 1e3 for p in runs["ptdp"]],
              "nanogpt_cpu_ms": [n[1] * 1e3 for n in runs["nanogpt"]],
              "ptdp_cpu_ms": [p[1] * 1e3 for p in runs["ptdp"]],
              "iters": args.iters, "window": [first, last], "ptdp_gelu": "tanh" if args.openai_gelu else "exact", "threads": args.threads, "load_average": os.getloadavg(),
              "machine": platform.machine(), "processor": platform.processor()}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"ptdp / nanoGPT per iteration: wall {result['median_wall_ratio']:.3f} (pairs "
              + ", ".join(f"{r:.3f}" for r in wall) + f"), CPU {result['median_cpu_ratio']:.3f} (pairs "
              + ", ".join(f"{r:.3f}" for r in cpu) + ") (goal <= 1.00)")


if __name__ == "__main__":
    main()
