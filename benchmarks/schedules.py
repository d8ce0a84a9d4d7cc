"""Pipeline schedules on real processes: our executor vs the ideal time and vs torch.distributed.pipelining.

Every stage is synthetic: a chunk's forward sleeps t_f/v and its backward 2*t_f/v, so compute time is known
exactly and the CPU count does not matter. The ideal step time is (m + (p-1)/v)(t_f + t_b), i.e. compute
plus the bubble fraction (p-1)/(v m) of ptdp-facts.md, §Schedules. Each schedule runs in the same process
group through ``ptdp.pipeline.run_schedule`` and through torch's ``ScheduleGPipe`` / ``Schedule1F1B`` /
``ScheduleInterleaved1F1B``; we report the median of several timed steps after warm-up.

    python benchmarks/schedules.py            # table
    python benchmarks/schedules.py --json     # one JSON object keyed by schedule
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ptdp.pipeline.executor import ModuleStage, run_schedule
from ptdp.pipeline.p2p import P2PComm
from ptdp.pipeline.schedules import bubble_fraction_formula, build_schedule

MICRO_BATCH, HIDDEN = 2, 64
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, t_f: float, t_b: float) -> torch.Tensor:
        ctx.t_b = t_b
        time.sleep(t_f)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.t_b)
        return grad.clone(), None, None


class SleepChunk(nn.Module):
    """A model chunk with a known cost: forward sleeps t_f, backward t_b. The scale makes stage 0 backward."""

    def __init__(self, t_f: float, t_b: float) -> None:
        super().__init__()
        self.t_f, self.t_b = t_f, t_b
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x * self.scale, self.t_f, self.t_b)


def _timed(step, repeats: int, warmup: int) -> float:
    """Median over ranks' slowest step time; a barrier lines the ranks up before each step."""
    times = []
    for i in range(warmup + repeats):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(elapsed.item())
    return statistics.median(times)


def _ours(name: str, rank: int, p: int, v: int, m: int, t_f: float, args) -> float:
    chunks = [SleepChunk(t_f / v, 2 * t_f / v) for _ in range(v)]
    x = torch.randn(m, MICRO_BATCH, HIDDEN)
    comm = P2PComm(list(range(p)), (MICRO_BATCH, HIDDEN))
    actions = build_schedule(name, p, v, m, rank)

    def step() -> None:
        stage = ModuleStage(chunks, rank, p, v, lambda mb: x[mb], lambda y, mb: (y**2).mean() / m)
        run_schedule(actions, stage, comm)

    return _timed(step, args.repeats, args.warmup)


def _theirs(name: str, rank: int, p: int, v: int, m: int, t_f: float, args) -> float:
    from torch.distributed import pipelining

    stages = [
        pipelining.PipelineStage(SleepChunk(t_f / v, 2 * t_f / v), c * p + rank, p * v, torch.device("cpu"))
        for c in range(v)
    ]
    schedule_cls = getattr(pipelining, TORCH_SCHEDULES[name])
    loss_fn = lambda y, target: (y**2).mean()  # noqa: E731
    schedule = schedule_cls(stages if name == "interleaved" else stages[0], m, loss_fn=loss_fn)
    x = torch.randn(m * MICRO_BATCH, HIDDEN)
    is_first = any(s.is_first for s in stages)
    is_last = any(s.is_last for s in stages)

    def step() -> None:
        kwargs = {"target": torch.zeros(m * MICRO_BATCH, HIDDEN), "losses": []} if is_last else {}
        schedule.step(*([x] if is_first else []), **kwargs)

    return _timed(step, args.repeats, args.warmup)


def _worker(rank: int, args, store: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.p,
                            timeout=timedelta(seconds=120))
    try:
        results = {}
        for name in args.schedules:
            v = args.v if name == "interleaved" else 1
            ours = _ours(name, rank, args.p, v, args.m, args.t_f, args)
            theirs = _theirs(name, rank, args.p, v, args.m, args.t_f, args)
            results[name] = (v, ours, theirs)
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, default=4, help="pipeline size (processes)")
    parser.add_argument("--m", type=int, default=8, help="microbatches per step")
    parser.add_argument("--v", type=int, default=2, help="model chunks per rank for 'interleaved'")
    parser.add_argument("--t-f", type=float, default=0.02, help="forward seconds of a whole stage; t_b = 2 t_f")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--schedules", nargs="+", default=list(TORCH_SCHEDULES), choices=list(TORCH_SCHEDULES))
    parser.add_argument("--json", action="store_true", help="print one JSON object keyed by schedule")
    args = parser.parse_args(argv)
    if args.p < 2 or args.m < 1 or args.v < 1 or args.t_f <= 0 or args.repeats < 1:
        print("benchmarks/schedules.py: need --p >= 2, --m >= 1, --v >= 1, --t-f > 0, --repeats >= 1",
              file=sys.stderr)
        return 2
    if "interleaved" in args.schedules and args.m % args.p:
        print(f"benchmarks/schedules.py: --m {args.m} must be a multiple of --p {args.p} for 'interleaved'",
              file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        mp.spawn(_worker, args=(args, str(Path(tmp) / "store"), str(out)), nprocs=args.p)
        raw = json.loads(out.read_text())

    t_step = args.t_f * 3  # t_f + t_b
    report = {}
    for name, (v, ours, theirs) in raw.items():
        ideal = args.m * t_step * (1 + bubble_fraction_formula(args.p, v, args.m))
        report[name] = {
            "p": args.p, "v": v, "m": args.m, "ours_s": ours, "torch_s": theirs, "ideal_s": ideal,
            "time_over_ideal": ours / ideal, "time_over_torch": ours / theirs, "torch_over_ideal": theirs / ideal,
        }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"p={args.p} m={args.m} t_f={args.t_f * 1e3:.0f}ms t_b={2 * args.t_f * 1e3:.0f}ms "
          f"NCCL-safe placement, median of {args.repeats} after {args.warmup} warm-up")
    print(f"{'schedule':<12} {'v':>2} {'ideal s':>8} {'ours s':>8} {'torch s':>8} {'ours/ideal':>11} "
          f"{'torch/ideal':>12} {'ours/torch':>11}")
    for name, r in report.items():
        print(f"{name:<12} {r['v']:>2} {r['ideal_s']:>8.3f} {r['ours_s']:>8.3f} {r['torch_s']:>8.3f} "
              f"{r['time_over_ideal']:>11.3f} {r['torch_over_ideal']:>12.3f} {r['time_over_torch']:>11.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
