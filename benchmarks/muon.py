"""Muon against AdamW: the optimizer step's time at d = 1 and d = 4, the Newton–Schulz work spread
over the data-parallel ranks, memory per rank against the formula, and the loss after N tokens.

``step``: a ~100M-parameter GPT (14 layers, h = 768, byte vocabulary) is set up as ``ptdp train`` sets it up
(``ptdp.train.state.setup``), one iteration is trained, then ``optimizer.step()`` is timed alone, AdamW and
Muon, at d = 1 and d = 4 (ZeRO-1), each rank a real process (gloo on a CPU, NCCL on GPUs). Per rank it
reports the step's wall time and the main thread's CPU time, and the Newton–Schulz part (the owner's
``orthogonalize_unit`` calls: the matrices it owns) -- at d = 4 each rank owns about a quarter of the
FLOPs, so the part should be near 1/4 of d = 1's. On a shared CPU the ranks compete for cores: the CPU
times (``time.thread_time``) are what compare across d, the wall times only within one run. Memory: the
model-state bytes counted from the tensors held against the formula (Muon: 4 bytes of state per
hidden-matrix parameter, AdamW's 8 on the rest), and the step's peak above its start against
``ptdp.planner.memory.muon_step_bytes_per_param`` (on a CPU the resident set's high-water mark, on a GPU
``max_memory_allocated``).

``loss``: the same small GPT trained on the embedded corpus (the Python standard library, bytes) for the
same tokens with AdamW and with Muon, each at a learning rate from a small sweep (Moonshot's recipe for
Muon: spectral scale x 0.2, AdamW's learning rate and weight decay), and the validation loss at the end.

    python benchmarks/muon.py step                  # d = 1 and d = 4, ~100M model
    python benchmarks/muon.py step --model 25m      # faster
    python benchmarks/muon.py loss --tokens 2000000 --json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ptdp.runtime.exit import exit_now

MODELS = {
    "100m": ["--num-layers", "14", "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "128"],
    "25m": ["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "128"],
    "small": ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128"],
}
OPTIMIZERS = {"adamw": ["--optimizer", "adam"], "muon": ["--optimizer", "muon"]}


# -- step: one rank -------------------------------------------------------------------------------------

def _rank(rank: int, world: int, port: int, argv: list[str], steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from ptdp.cli.main import build_parser
    from ptdp.config import config_from_args, derive
    from ptdp.optim.kinds import Chained
    from ptdp.optim.memory import model_state_bytes, window_peak_bytes
    from ptdp.optim.muon import Muon, placement_of
    from ptdp.optim.muon_units import is_hidden_matrix
    from ptdp.train.state import setup
    from ptdp.train.step import train_step

    torch.set_num_threads(1)
    trainer = setup(derive(config_from_args(build_parser().parse_args(["train", *argv]))))
    device = trainer.plan.groups.device
    inner = trainer.optimizer.optimizer
    ns = {"wall": 0.0, "cpu": 0.0, "flops": 0.0}
    muon = next((m for m in inner.members if isinstance(m, Muon)), None) if isinstance(inner, Chained) else None
    steps_of_ns = trainer.config.optimizer.muon_num_ns_steps
    if muon is not None:  # time the owner's Newton–Schulz calls
        run = muon.exchange.orthogonalize_unit

        def timed(full, unit):
            sync(device)
            wall, cpu = time.perf_counter(), time.thread_time()
            result = run(full, unit)
            sync(device)
            ns["wall"] += time.perf_counter() - wall
            ns["cpu"] += time.thread_time() - cpu
            ns["flops"] += unit.flops(steps_of_ns)
            return result

        muon.exchange.orthogonalize_unit = timed
    train_step(trainer, 1)  # gradients in place, the optimizer's state allocated
    records = []
    for _ in range(steps):
        for key in ns:
            ns[key] = 0.0
        dist.barrier() if world > 1 else None
        window_peak_bytes(device)  # reset the peak: what follows is the step's
        before = _current_bytes(device)
        sync(device)
        wall, cpu = time.perf_counter(), time.thread_time()
        trainer.optimizer.step()
        sync(device)
        records.append({"wall_s": time.perf_counter() - wall, "cpu_s": time.thread_time() - cpu,
                        "ns_wall_s": ns["wall"], "ns_cpu_s": ns["cpu"], "ns_flops": ns["flops"],
                        "step_peak_bytes": window_peak_bytes(device) - before})
    params = trainer.params
    matrices = sum(p.numel() for p in params if is_hidden_matrix(placement_of(p, trainer.placements), p))
    result = {"rank": rank, "params": sum(p.numel() for p in params), "matrix_params": matrices,
              "model_state_bytes": model_state_bytes(params, trainer.grads, trainer.optimizer)["total"],
              "steps": records}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    exit_now(0)  # not through the interpreter's teardown, which gloo's threads can abort (ptdp/runtime/exit.py)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _current_bytes(device) -> int:
    import torch

    from ptdp.optim.memory import _status_bytes

    return torch.cuda.memory_allocated(device) if device.type == "cuda" else _status_bytes("VmRSS")


def measure_step(model: str, optimizer: str, world: int, steps: int, extra: list[str]) -> list[dict]:
    import torch.multiprocessing as mp

    argv = [*MODELS[model], "--micro-batch-size", "1", "--global-batch-size", str(world), "--train-iters", "2",
            "--hidden-dropout", "0", "--attention-dropout", "0", *OPTIMIZERS[optimizer], *extra,
            *(["--use-distributed-optimizer"] if world > 1 else [])]
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(2**20))  # freed buffers leave the RSS (the launcher's)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(world, port, argv, steps, out), nprocs=world, start_method="spawn")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def _median(ranks: list[dict], key: str, worst: bool = True) -> float:
    """The median over the timed steps of the slowest rank's ``key`` (or the mean rank's)."""
    per_step = [[r["steps"][k][key] for r in ranks] for k in range(len(ranks[0]["steps"]))]
    return statistics.median(max(s) if worst else statistics.mean(s) for s in per_step)


def step_report(args) -> dict:
    from ptdp.planner.memory import muon_step_bytes_per_param

    rows = {}
    for world in (1, 4):
        for optimizer in ("adamw", "muon"):
            ranks = measure_step(args.model, optimizer, world, args.steps, args.extra)
            r0 = ranks[0]
            matrix, rest = r0["matrix_params"], r0["params"] - r0["matrix_params"]
            shards = world  # ZeRO-1 at d > 1
            state = (4 * matrix + 8 * rest) if optimizer == "muon" else 8 * r0["params"]
            formula_states = r0["params"] * 8 + state / shards  # fp32 params + grads, then the optimizer's state
            rows[f"{optimizer}_d{world}"] = {
                "step_wall_s": _median(ranks, "wall_s"), "step_cpu_s": _median(ranks, "cpu_s"),
                "ns_cpu_s": _median(ranks, "ns_cpu_s"), "ns_wall_s": _median(ranks, "ns_wall_s"),
                "ns_flops_share": [statistics.median(s["ns_flops"] for s in r["steps"]) for r in ranks],
                # ZeRO cuts buckets by position, not by kind: a rank's mix of Muon (4 B) and AdamW (8 B) state
                # varies around the mean, which the formula gives
                "model_state_bytes_mean": statistics.mean(r["model_state_bytes"] for r in ranks),
                "model_state_bytes_per_rank": [r["model_state_bytes"] for r in ranks],
                "model_state_formula_bytes": formula_states,
                "step_peak_bytes": max(max(s["step_peak_bytes"] for s in r["steps"]) for r in ranks),
                "step_formula_bytes": matrix * muon_step_bytes_per_param(shards, world) if optimizer == "muon" else 0,
                "params": r0["params"], "matrix_params": matrix,
            }
    total = sum(rows["muon_d1"]["ns_flops_share"])
    rows["ratios"] = {
        "muon/adamw step cpu d1": rows["muon_d1"]["step_cpu_s"] / rows["adamw_d1"]["step_cpu_s"],
        "muon/adamw step cpu d4": rows["muon_d4"]["step_cpu_s"] / rows["adamw_d4"]["step_cpu_s"],
        "ns cpu d4 (slowest rank) / d1": rows["muon_d4"]["ns_cpu_s"] / rows["muon_d1"]["ns_cpu_s"],
        "ns flops d4 (largest share) / d1": max(rows["muon_d4"]["ns_flops_share"]) / total,
        "muon step cpu d4 / d1": rows["muon_d4"]["step_cpu_s"] / rows["muon_d1"]["step_cpu_s"],
    }
    return rows


# -- loss after N tokens ----------------------------------------------------------------------------------

def loss_run(optimizer: str, lr: float, args, workdir: Path) -> float:
    batch, seq = 16, 128
    iters = max(args.tokens // (batch * seq), 2)
    metrics = workdir / f"{optimizer}-{lr}.jsonl"
    extra = ["--muon-extra-scale-factor", "0.2"] if optimizer == "muon" else []
    cmd = [sys.executable, "-m", "ptdp", "train", *MODELS[args.loss_model], "--micro-batch-size", "8",
           "--global-batch-size", str(batch), "--train-iters", str(iters), "--lr", str(lr),
           "--min-lr", str(lr / 10), "--lr-warmup-iters", str(max(iters // 20, 1)), "--weight-decay", "0.1",
           "--adam-beta2", "0.95", "--hidden-dropout", "0", "--attention-dropout", "0",
           "--eval-interval", str(iters), "--eval-iters", "8", "--log-interval", str(iters),
           "--metrics-file", str(metrics), *OPTIMIZERS[optimizer], *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise SystemExit(f"muon.py: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return next(r["val_loss"] for r in reversed(records) if "val_loss" in r)


def loss_report(args) -> dict:
    out = {"tokens": args.tokens, "model": args.loss_model}
    with tempfile.TemporaryDirectory() as tmp:
        for optimizer, lrs in (("adamw", args.adamw_lrs), ("muon", args.muon_lrs)):
            sweep = {lr: loss_run(optimizer, lr, args, Path(tmp)) for lr in lrs}
            best = min(sweep, key=sweep.get)
            out[optimizer] = {"val_loss_by_lr": sweep, "best_lr": best, "val_loss": sweep[best]}
    out["muon - adamw val loss"] = out["muon"]["val_loss"] - out["adamw"]["val_loss"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    step = sub.add_parser("step", help="optimizer step time and memory at d = 1 and d = 4")
    step.add_argument("--model", choices=list(MODELS), default="100m")
    step.add_argument("--steps", type=int, default=3, help="timed steps per case")
    step.add_argument("--extra", nargs="*", default=[], help="more ptdp train flags, e.g. --bf16")
    loss = sub.add_parser("loss", help="validation loss after N tokens, AdamW and Muon")
    loss.add_argument("--tokens", type=int, default=1_000_000)
    loss.add_argument("--loss-model", choices=list(MODELS), default="small")
    loss.add_argument("--adamw-lrs", type=float, nargs="+", default=[1e-3, 3e-3])
    loss.add_argument("--muon-lrs", type=float, nargs="+", default=[1e-3, 3e-3])
    for p in (step, loss):
        p.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = step_report(args) if args.what == "step" else loss_report(args)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for key, value in result.items():
        print(f"{key}: {json.dumps(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
