"""Pipeline schedules on real processes: our executor vs the ideal time and vs torch.distributed.pipelining.

Every stage is synthetic, so compute time is known exactly and the CPU count does not matter: a stage's
forward sleeps t_F, its input gradient (I) t_B, its weight gradient (W) t_W, and a full backward (B)
t_B + t_W, each chunk 1/v of that so every schedule does the same work. The papers' case (Qi et al.;
docs/references.md, §Zero-bubble and V schedules) is t_F = t_B = t_W, the default. The ideal step time is
m·(t_F+t_B+t_W)·(1 + bubble_fraction_formula(p, v, m, schedule)) with free communication (docs/references.md,
§Schedules); ``bubble_fraction`` is the measured step time over m·(t_F+t_B+t_W), minus one.

ptdp's side runs ``ptdp.parallel.pipeline.run_schedule`` on ``SleepStage`` (the ``PipelineStage`` protocol with
those sleeps: the B/W split's real cost is ``benchmarks/bw_split.py``'s business, not the schedule's).
torch's side runs its ``PipelineStage`` on ``SleepChunk``, whose autograd graph makes torch's own split
cost the same: ``stage_backward_input`` reaches the input only through ``_SleepInput`` (t_B) and
``stage_backward_weight`` the weight only through ``_SleepWeight`` (t_W). One torch behaviour is kept as
it is: on the first stage torch skips I and runs the full backward (t_B + t_W) as W.
Compared: gpipe/1f1b/interleaved with torch's ``ScheduleGPipe``/``Schedule1F1B``/``ScheduleInterleaved1F1B``,
zb-h1 with ``ScheduleInterleavedZeroBubble`` on one stage per rank (its ZB1P is ZB-H1 there), zbv with
``ScheduleZBVZeroBubble`` (V placement), dualpipev with ``ScheduleDualPipeV`` (its pairs run F then B on both
sides: a sleep is compute, which the overlap does not hide; the expert communication it does hide is
``benchmarks/dualpipe.py``'s). zb-h2, v-half and v-min have no torch counterpart. dualpipev needs m >= 2p.

    python benchmarks/schedules.py                 # table, m = 8 and m = 16
    python benchmarks/schedules.py --json --m 8    # one JSON object keyed by schedule (one line per m)
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
from torch import Tensor, nn

from ptdp.parallel.pipeline.executor import run_schedule
from ptdp.parallel.pipeline.overlap import overlap_handlers
from ptdp.parallel.pipeline.p2p import P2PComm
from ptdp.runtime.exit import exit_now
from ptdp.schedule.actions import virtual_stage
from ptdp.schedule.registry import (
    SCHEDULES,
    ZERO_BUBBLE,
    bubble_fraction_formula,
    build_schedule,
    schedule_placement,
)

MICRO_BATCH, HIDDEN = 2, 64
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "zb-h1": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
                   "dualpipev": "ScheduleDualPipeV"}
V_OF = {"interleaved": None, "zbv": 2, "v-half": 2, "v-min": 2, "dualpipev": 2}  # None: --v


class SleepStage:
    """ptdp ``PipelineStage`` whose F, I, W and B sleep t_F, t_B, t_W and t_B + t_W per chunk."""

    def __init__(self, rank: int, p: int, v: int, x: Tensor, t_f: float, t_b: float, t_w: float,
                 placement: str) -> None:
        self.rank, self.p, self.v, self.x, self.placement = rank, p, v, x, placement
        self.t_f, self.t_b, self.t_w = t_f, t_b, t_w
        self.losses: dict[int, Tensor] = {}

    def parameters(self) -> list[nn.Parameter]:
        return []

    def handlers(self) -> dict:
        return {}

    def _first(self, chunk: int) -> bool:
        return virtual_stage(self.rank, chunk, self.p, self.placement) == 0

    def _last(self, chunk: int) -> bool:
        return virtual_stage(self.rank, chunk, self.p, self.placement) == self.p * self.v - 1

    def forward(self, chunk: int, microbatch: int, input: Tensor | None) -> Tensor | None:
        time.sleep(self.t_f)
        return None if self._last(chunk) else (self.x[microbatch] if input is None else input).clone()

    def _grad(self, chunk: int, microbatch: int, output_grad: Tensor | None) -> Tensor | None:
        if self._first(chunk):
            return None
        return self.x[microbatch].clone() if output_grad is None else output_grad.clone()

    def backward(self, chunk: int, microbatch: int, output_grad: Tensor | None) -> Tensor | None:
        time.sleep(self.t_b + self.t_w)
        return self._grad(chunk, microbatch, output_grad)

    def backward_input(self, chunk: int, microbatch: int, output_grad: Tensor | None) -> Tensor | None:
        time.sleep(self.t_b)
        return self._grad(chunk, microbatch, output_grad)

    def backward_weight(self, chunk: int, microbatch: int) -> None:
        time.sleep(self.t_w)

    def forward_backward(self, forward, input, backward, output_grad, saving):
        """An overlapped pair: sleeps are compute, which the overlap does not hide (it hides communication,
        which this stage has none of), so F then B, as torch's ScheduleDualPipeV runs a pair without a
        custom overlap callback."""
        y = self.forward(forward.chunk, forward.microbatch, input)
        run = self.backward if backward.op == "B" else self.backward_input
        return y, run(backward.chunk, backward.microbatch, output_grad)


class _SleepInput(torch.autograd.Function):
    """The input path: forward sleeps t_F, backward (the input gradient) t_B."""

    @staticmethod
    def forward(ctx, x: Tensor, t_f: float, t_b: float) -> Tensor:
        ctx.t_b = t_b
        time.sleep(t_f)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        time.sleep(ctx.t_b)
        return grad.clone(), None, None


class _SleepWeight(torch.autograd.Function):
    """The weight path, off the input's: free forward, backward (the weight gradient) sleeps t_W."""

    @staticmethod
    def forward(ctx, like: Tensor, w: Tensor, t_w: float) -> Tensor:
        ctx.t_w = t_w
        return torch.zeros_like(like)

    @staticmethod
    def backward(ctx, grad: Tensor):
        time.sleep(ctx.t_w)
        return None, grad.sum().reshape(1), None


class SleepChunk(nn.Module):
    """A torch model chunk with known costs: y = _SleepInput(x) + _SleepWeight(x.detach(), w).

    torch's I (``autograd.grad`` to the input) runs only ``_SleepInput``'s backward and its W (grad from
    the saved add node to w) only ``_SleepWeight``'s; a full backward runs both. A first-stage input
    becomes a leaf that requires grad so that the full backward torch runs there costs t_B + t_W too.
    """

    def __init__(self, t_f: float, t_b: float, t_w: float) -> None:
        super().__init__()
        self.t_f, self.t_b, self.t_w = t_f, t_b, t_w
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: Tensor) -> Tensor:
        if not x.requires_grad:
            x = x.detach().requires_grad_(True)
        return _SleepInput.apply(x, self.t_f, self.t_b) + _SleepWeight.apply(x.detach(), self.scale, self.t_w)


def _timed(step, repeats: int, warmup: int) -> tuple[float, float]:
    """(median over steps of the slowest rank's step time, the busiest rank's median CPU time per step);
    a barrier lines the ranks up before each step. The stages sleep, so a step's CPU time is the schedule
    machinery's own (executor, p2p, gloo's threads, the tensors handed on): a yardstick that the load of a
    shared machine hardly moves, where the step time waits for every rank to be scheduled again."""
    times, cpu = [], []
    for i in range(warmup + repeats):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        c1 = time.process_time()
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(elapsed.item())
            cpu.append(c1 - c0)
    busiest = torch.tensor([statistics.median(cpu)])
    dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
    return statistics.median(times), busiest.item()


def _ours(name: str, rank: int, p: int, v: int, m: int, args) -> tuple[float, float, float]:
    """(median step time, the busiest rank's CPU time per step, the slowest rank's median busy time): busy
    over m·(t_F+t_B+t_W) is how much the sleeps overran (CPU load delays each wake-up), apart from the bubble."""
    x = torch.randn(m, MICRO_BATCH, HIDDEN)
    comm = P2PComm(list(range(p)), (MICRO_BATCH, HIDDEN))
    actions = build_schedule(name, p, v, m, rank)
    stage = SleepStage(rank, p, v, x, args.t_f / v, args.t_b / v, args.t_w / v, schedule_placement(name))
    busy: list[float] = []

    def step() -> None:
        busy.append(run_schedule(actions, stage, comm, overlap_handlers(), count_saved_bytes=False).busy_s)

    took, cpu = _timed(step, args.repeats, args.warmup)
    slowest = torch.tensor([statistics.median(busy[args.warmup:])])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return took, cpu, slowest.item()


def _theirs(name: str, rank: int, p: int, v: int, m: int, args) -> tuple[float, float]:
    from torch.distributed import pipelining

    placement = schedule_placement(name)
    stages = [
        pipelining.PipelineStage(SleepChunk(args.t_f / v, args.t_b / v, args.t_w / v),
                                 virtual_stage(rank, c, p, placement), p * v, torch.device("cpu"))
        for c in range(v)
    ]
    schedule_cls = getattr(pipelining, TORCH_SCHEDULES[name])
    loss_fn = lambda y, target: (y**2).mean()  # noqa: E731
    single = name in ("gpipe", "1f1b")
    schedule = schedule_cls(stages[0] if single else stages, m, loss_fn=loss_fn)
    x = torch.randn(m * MICRO_BATCH, HIDDEN)
    is_first = any(s.is_first for s in stages)
    is_last = any(s.is_last for s in stages)

    def step() -> None:
        kwargs = {"target": torch.zeros(m * MICRO_BATCH, HIDDEN), "losses": []} if is_last else {}
        schedule.step(*([x] if is_first else []), **kwargs)

    return _timed(step, args.repeats, args.warmup)


def chunks_per_rank(name: str, v: int) -> int:
    """v of schedule ``name``: --v for interleaved, 2 for the V schedules, else 1."""
    return v if V_OF.get(name, 1) is None else V_OF.get(name, 1)


def _worker(rank: int, args, store: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.p,
                            timeout=timedelta(seconds=300))
    try:
        results = []
        for m in args.m:
            per_m = {}
            for name in args.schedules:
                v = chunks_per_rank(name, args.v)
                ours, ours_cpu, busy = _ours(name, rank, args.p, v, m, args)
                theirs, theirs_cpu = _theirs(name, rank, args.p, v, m, args) if name in TORCH_SCHEDULES else (None, None)
                per_m[name] = (v, ours, theirs, busy, ours_cpu, theirs_cpu)
            results.append((m, per_m))
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()
    exit_now(0)  # not through the interpreter's teardown, which gloo's threads can abort (ptdp/runtime/exit.py)


def _bad(message: str) -> int:
    print(f"benchmarks/schedules.py: error: {message}", file=sys.stderr)
    return 2


def report_for(args, m: int, raw: dict) -> dict:
    """Per schedule: times, ideal, measured and formula bubble, ratios (None where torch has none)."""
    work = m * (args.t_f + args.t_b + args.t_w)
    report = {}
    for name, (v, ours, theirs, busy, ours_cpu, theirs_cpu) in raw.items():
        formula = bubble_fraction_formula(args.p, v, m, schedule=name)
        ideal = work * (1 + formula)
        report[name] = {
            "p": args.p, "v": v, "m": m, "ours_s": ours, "torch_s": theirs, "ideal_s": ideal,
            "time_over_ideal": ours / ideal, "time_over_torch": None if theirs is None else ours / theirs,
            "torch_over_ideal": None if theirs is None else theirs / ideal,
            "bubble_fraction": ours / work - 1, "bubble_fraction_formula": formula,
            "torch_bubble_fraction": None if theirs is None else theirs / work - 1,
            "torch_schedule": TORCH_SCHEDULES.get(name),
            "busy_over_work": busy / work,  # > 1: the sleeps overran (load), not a schedule bubble
            # the busiest rank's CPU time per step (the stages sleep: this is the machinery's own cost)
            "ours_cpu_s": ours_cpu, "torch_cpu_s": theirs_cpu,
            "cpu_over_torch": None if theirs_cpu is None else ours_cpu / theirs_cpu,
        }
    return report


def goals(report: dict, work: float) -> list[str]:
    """The schedules' goals that this run can judge, each with its verdict."""
    lines = []
    for name in ("zbv", "zb-h2"):
        if name in report:
            ratio = report[name]["ours_s"] / work
            lines.append(f"{name} within 5% of m(t_F+t_B+t_W): {ratio:.3f} -> {'met' if ratio <= 1.05 else 'NOT met'}")
    if "zb-h1" in report and "1f1b" in report:
        ratio = report["zb-h1"]["ours_s"] / report["1f1b"]["ours_s"]
        lines.append(f"zb-h1 <= 0.8 x 1f1b: {ratio:.3f} -> {'met' if ratio <= 0.8 else 'NOT met'}")
    for name, r in report.items():
        if name == "dualpipev" and r["time_over_torch"] is not None:  # no slower than torch's
            verdict = "met" if r["time_over_torch"] <= 1 else "NOT met"
            lines.append(f"dualpipev no slower than torch ScheduleDualPipeV: {r['time_over_torch']:.3f} -> {verdict}")
        elif name in ZERO_BUBBLE and r["time_over_torch"] is not None:
            verdict = "met" if r["time_over_torch"] < 1 else "NOT met"
            lines.append(f"{name} ahead of torch {r['torch_schedule']}: {r['time_over_torch']:.3f} -> {verdict}")
    return lines


def _fmt(x: float | None, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, default=4, help="pipeline size (processes)")
    parser.add_argument("--m", type=int, nargs="+", default=[8, 16], help="microbatches per step (a list)")
    parser.add_argument("--v", type=int, default=2, help="model chunks per rank for 'interleaved'")
    parser.add_argument("--t-f", type=float, default=0.02, help="forward seconds of a whole stage")
    parser.add_argument("--t-b", type=float, default=None, help="input-gradient (I) seconds; default t_f")
    parser.add_argument("--t-w", type=float, default=None, help="weight-gradient (W) seconds; default t_f")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    parser.add_argument("--json", action="store_true", help="print one JSON object keyed by schedule per m")
    args = parser.parse_args(argv)
    args.t_b = args.t_f if args.t_b is None else args.t_b
    args.t_w = args.t_f if args.t_w is None else args.t_w
    if args.p < 2 or min(args.m) < 1 or args.v < 1 or args.repeats < 1:
        return _bad("need --p >= 2, --m >= 1, --v >= 1, --repeats >= 1")
    if min(args.t_f, args.t_b, args.t_w) <= 0:
        return _bad("--t-f, --t-b and --t-w must be > 0")
    if "interleaved" in args.schedules and any(m % args.p for m in args.m):
        return _bad(f"--m {args.m} must be multiples of --p {args.p} for 'interleaved'")
    if "dualpipev" in args.schedules and min(args.m) < 2 * args.p:
        return _bad(f"--m {args.m} must be at least 2 x --p = {2 * args.p} for 'dualpipev'")

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        mp.spawn(_worker, args=(args, str(Path(tmp) / "store"), str(out)), nprocs=args.p)
        raw = json.loads(out.read_text())

    for m, per_m in raw:
        report = report_for(args, m, per_m)
        if args.json:
            print(json.dumps(report))
            continue
        print(f"p={args.p} m={m} t_F={args.t_f * 1e3:.0f}ms t_B={args.t_b * 1e3:.0f}ms t_W={args.t_w * 1e3:.0f}ms "
              f"NCCL-safe placement, median of {args.repeats} after {args.warmup} warm-up")
        print(f"{'schedule':<12} {'v':>2} {'ideal s':>8} {'ours s':>8} {'torch s':>8} {'ours/ideal':>11} "
              f"{'torch/ideal':>12} {'ours/torch':>11} {'bubble':>7} {'formula':>8} {'busy/work':>9} {'cpu ms':>7} "
              f"{'cpu/torch':>9}")
        for name, r in report.items():
            print(f"{name:<12} {r['v']:>2} {r['ideal_s']:>8.3f} {r['ours_s']:>8.3f} {_fmt(r['torch_s'], 8)} "
                  f"{r['time_over_ideal']:>11.3f} {_fmt(r['torch_over_ideal'], 12)} {_fmt(r['time_over_torch'], 11)} "
                  f"{r['bubble_fraction']:>7.3f} {r['bubble_fraction_formula']:>8.3f} {r['busy_over_work']:>9.3f} "
                  f"{r['ours_cpu_s'] * 1e3:>7.1f} {_fmt(r['cpu_over_torch'], 9)}")
        for line in goals(report, m * (args.t_f + args.t_b + args.t_w)):
            print("  goal: " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
