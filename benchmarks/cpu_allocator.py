"""CPU workers' memory and speed under glibc's default malloc against a pinned mmap threshold.

    python benchmarks/cpu_allocator.py --json                  # the reference case, 2 rounds
    python benchmarks/cpu_allocator.py --layers 2 --seq 256    # smaller, quicker

glibc serves an allocation of at least the *mmap threshold* with its own ``mmap`` and gives it back to the
kernel on ``free``; smaller ones come from the heap, whose free space stays in the process. The threshold
starts at 128 KiB and is *dynamic*: each freed mmapped block raises it to that block's size (up to 32 MiB),
so after the first iteration a training process serves its activations from the heap, and its resident set
keeps the high-water mark of whatever pattern of sizes it ever had -- a feature that frees activations does
not show in the RSS. ``MALLOC_MMAP_THRESHOLD_`` (or ``mallopt``) pins the threshold and turns the dynamic
rule off: every tensor of at least that size is its own mapping, returned when freed.

Each case trains the reference model (t = 2 on 2 CPU processes, h = 256, s = 1024, b = 8, 8 layers, fp32)
through ``ptdp train`` for ``--iters`` iterations, with and without ``--sequence-parallel``, under ptdp's
launcher default (the threshold pinned, ``--cpu-mmap-threshold 1048576``) and under glibc's own dynamic
threshold (``--cpu-mmap-threshold 0``). Reported per case: the workers' peak RSS, ptdp's
``peak_memory_bytes_per_rank`` (the last window's), the saved activations, and the median iteration time
after the first; per setting, the pinned threshold's time over the default's, from rounds that alternate
the order (the same run, the same machine). Under other jobs' load wall time is noise, so ``speed`` also
trains the same model in one process per threshold and compares the CPU time each process used per
iteration (user + system), rounds alternating the order.
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

ROOT = Path(__file__).resolve().parent.parent


def run_case(args: argparse.Namespace, sequence_parallel: bool, threshold: int, workdir: Path) -> dict:
    metrics = workdir / f"m-{sequence_parallel}-{threshold}-{os.urandom(3).hex()}.jsonl"
    command = [sys.executable, "-m", "ptdp", "train", "--num-layers", str(args.layers), "--hidden-size",
               str(args.hidden), "--num-attention-heads", "8", "--seq-length", str(args.seq), "--micro-batch-size",
               str(args.batch), "--global-batch-size", str(args.batch), "--train-iters", str(args.iters),
               "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
               "--tensor-model-parallel-size", "2", "--nproc-per-node", "2", "--metrics-file", str(metrics),
               "--cpu-mmap-threshold", str(threshold), *(["--sequence-parallel"] if sequence_parallel else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)  # the flag decides
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"cpu_allocator.py: ptdp train failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {"peak_resident_mib": max(records[-1]["peak_resident_bytes_per_rank"]) / 2**20,
            "peak_memory_gb": max(records[-1]["peak_memory_bytes_per_rank"]) / 1e9,
            "peak_activation_mb": records[0]["peak_activation_bytes"] / 1e6,
            "iteration_s": statistics.median(r["iteration_time_s"] for r in records[1:]),
            "losses": [r["loss"] for r in records]}


def speed_worker(args: argparse.Namespace) -> None:
    """In a process of its own (glibc reads ``MALLOC_MMAP_THRESHOLD_`` at start): the same model at t = 1,
    per iteration the process's CPU time (user + system: the page faults of fresh mappings are system time)
    and wall time; one JSON line."""
    import time

    import torch
    from overhead import ptdp_trainer

    from ptdp.train.step import train_step

    torch.set_num_threads(1)
    trainer = ptdp_trainer(argparse.Namespace(layers=args.layers, hidden=args.hidden, heads=8, seq=args.seq,
                                              micro_batch=args.batch, microbatches=1, llama=False, groups=1))
    cpu, wall = [], []
    for it in range(1, args.iters + 1):
        c0, w0 = time.process_time(), time.perf_counter()
        train_step(trainer, it)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    print(json.dumps({"cpu_s": cpu[1:], "wall_s": wall[1:]}))


def speed(args: argparse.Namespace) -> dict:
    """Pinned threshold against glibc's dynamic one, one process each, rounds alternating the order: the
    median over rounds of the two runs' median CPU time per iteration (robust to other jobs' load, which
    moves wall time but hardly the CPU time a process itself uses), and the wall-time ratio beside it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    command = [sys.executable, __file__, "--speed-worker", "--layers", str(args.layers), "--hidden", str(args.hidden),
               "--seq", str(args.seq), "--batch", str(args.batch), "--iters", str(args.speed_iters)]
    runs: dict[str, list[dict]] = {"pinned": [], "dynamic": []}
    for r in range(args.rounds):
        for kind in ("pinned", "dynamic") if r % 2 == 0 else ("dynamic", "pinned"):
            extra = {"MALLOC_MMAP_THRESHOLD_": str(args.threshold)} if kind == "pinned" else {}
            proc = subprocess.run(command, capture_output=True, text=True, env={**env, **extra})
            if proc.returncode:
                raise SystemExit(f"cpu_allocator.py: the speed worker failed:\n{proc.stderr[-3000:]}")
            runs[kind].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    med = statistics.median
    return {"cpu_s_per_iteration": {k: med(med(run["cpu_s"]) for run in v) for k, v in runs.items()},
            "pinned_over_dynamic_cpu_time": med(med(p["cpu_s"]) / med(d["cpu_s"])
                                                for p, d in zip(runs["pinned"], runs["dynamic"], strict=True)),
            "pinned_over_dynamic_wall_time": med(med(p["wall_s"]) / med(d["wall_s"])
                                                 for p, d in zip(runs["pinned"], runs["dynamic"], strict=True)),
            "iterations_timed": args.speed_iters - 1, "rounds": args.rounds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--iters", type=int, default=4, help="iterations per run (the first is not timed)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, alternating the order of the two thresholds")
    parser.add_argument("--threshold", type=int, default=1 << 20, help="the pinned threshold measured (bytes)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--parts", nargs="+", choices=["memory", "speed"], default=["memory", "speed"])
    parser.add_argument("--speed-iters", type=int, default=6, help="iterations per speed run (the first not timed)")
    parser.add_argument("--speed-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.speed_worker:
        speed_worker(args)
        return 0
    out = {"benchmark": "cpu_allocator", "threshold": args.threshold, "rounds": args.rounds,
           "model": {"layers": args.layers, "hidden": args.hidden, "seq": args.seq, "batch": args.batch}}
    if "memory" in args.parts:
        out |= memory(args)
    if "speed" in args.parts:
        out["speed"] = speed(args)
    if args.json:
        print(json.dumps(out))
        return 0
    for key, case in out.get("cases", {}).items():
        print(f"{key:12s} peak RSS {case['peak_resident_mib']:7.0f} MiB  peak_memory {case['peak_memory_gb']:.3f} GB  "
              f"saved activations {case['peak_activation_mb']:6.1f} MB  {case['iteration_s']:.2f} s/iteration")
    if "cases" in out:
        print(f"RSS change with --sequence-parallel (MiB): {out['sequence_parallel_rss_change_mib']}")
    if "speed" in out:
        print(f"speed, one process: {out['speed']}")
    return 0


def memory(args: argparse.Namespace) -> dict:
    """The four ``ptdp train`` cases at t = 2 (module docstring)."""
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for sp in (False, True):
                order = (0, args.threshold) if r % 2 == 0 else (args.threshold, 0)
                for threshold in order:
                    key = f"{'sp' if sp else 'tp'}-{'pinned' if threshold else 'dynamic'}"
                    runs.setdefault(key, []).append(run_case(args, sp, threshold, Path(tmp)))
    cases = {key: {field: statistics.median(c[field] for c in found) for field in found[0] if field != "losses"}
             | {"losses": found[0]["losses"]} for key, found in runs.items()}
    return {"cases": cases, "t": 2,
            "pinned_over_dynamic_wall_time_t2": {s: statistics.median(
                p["iteration_s"] / d["iteration_s"] for p, d in zip(runs[f"{s}-pinned"], runs[f"{s}-dynamic"],
                                                                    strict=True)) for s in ("tp", "sp")},
            "sequence_parallel_rss_change_mib": {
                kind: cases[f"sp-{kind}"]["peak_resident_mib"] - cases[f"tp-{kind}"]["peak_resident_mib"]
                for kind in ("dynamic", "pinned")}}


if __name__ == "__main__":
    sys.exit(main())
