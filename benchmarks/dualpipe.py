"""DualPipeV's overlap on CPU processes (gloo): how much of the expert all-to-all it hides, and its schedule.

Two parts, each a comparison inside one run (the machine is shared: only ratios of the same run mean anything).

``--part moe``: the real MoE model trained by ``ptdp.train.loop.train`` under dualpipev at p = 2 with the experts
split over e = 4 (8 gloo processes), the all-to-all dispatcher. On a CPU a gloo all-to-all of a tiny model costs
little next to its compute, so every expert exchange also waits out a network latency (``--latency-ms``: the
exchange completes no earlier than that after it was issued, like a slow link; the real all-to-all still
runs) -- that makes the all-to-all a measured share of the step. Each exchange's exposed time is what the
rank spent waiting for it. The same run is made twice: the overlapped pairs as ptdp runs them (their pieces
interleaved), and "sequential": the same list, pieces and exchanges, but each pair's forward run to the end
before its backward (``ptdp.parallel.pipeline.module_stage.interleave`` swapped for that). Reported: the
all-to-all share of the sequential step, the share of all-to-all time hidden (1 - exposed with overlap /
exposed sequential; over the pairs' exchanges, the goal >= 70%, and over all), and the iteration time ratio.

``--part dense``: the same measurement on a DENSE model at t = 2 under dualpipev at p = 2 (4 gloo processes):
the exchanges timed (and given the latency floor) are each layer's tensor-parallel collectives, which a layer
run in pieces issues asynchronously (``ptdp.parallel.tensor.transfers``; ``--sequence-parallel`` with
``--sequence-parallel``): the all-reduces of the row-parallel outputs (forward) and of the column-parallel
input gradients (backward).

``--part sleep``: a sleep-timed pipeline (p = 4 ranks) whose chunks are MoE-like programs run by the real
pieces engine: compute pieces sleep (forward t_F, input gradient t_B, weight gradient t_W per stage, split over
the pieces) and the dispatch and combine exchanges are timers of ``--comm-fraction`` of the compute. Without
communication: dualpipev's time over its ideal m·(t_F+t_B+t_W)·(1 + (p-1)/(3m)) (goal <= 1.05) and over
zbv's time; with it: dualpipev overlapped, dualpipev sequential and zbv (which cannot hide it). The
sleep-timed comparison with torch's ``ScheduleDualPipeV`` is ``benchmarks/schedules.py``'s.

    python benchmarks/dualpipe.py --part moe --latency-ms 10
    python benchmarks/dualpipe.py --part dense --latency-ms 10
    python benchmarks/dualpipe.py --part sleep --m 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from ptdp.models.pieces import BackwardRun, Compute, Exchange, ForwardRun, fuse, interleave
from ptdp.parallel.pipeline.executor import run_schedule
from ptdp.parallel.pipeline.overlap import overlap_handlers
from ptdp.parallel.pipeline.p2p import P2PComm
from ptdp.runtime.exit import exit_now
from ptdp.schedule.actions import virtual_stage
from ptdp.schedule.registry import bubble_fraction_formula, build_schedule, schedule_placement

# ----------------------------------------------------------------------------------- part 1: the MoE model

MOE_MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64",
             "--micro-batch-size", "2", "--global-batch-size", "64", "--lr", "1e-4", "--lr-warmup-iters", "1",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--num-experts", "8", "--moe-router-topk", "2",
             "--moe-token-dispatcher-type", "alltoall", "--vocab-size", "512", "--log-interval", "1",
             "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "dualpipev",
             "--expert-model-parallel-size", "4"]
DENSE_MODEL = [*MOE_MODEL[:MOE_MODEL.index("--num-experts")], "--vocab-size", "512", "--log-interval", "1",
               "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "dualpipev",
               "--tensor-model-parallel-size", "2"]
# the functions whose results are the timed exchanges: (module, name)
TIMED = {"moe": [("ptdp.parallel.expert.dispatch", "_all_to_all_async")],
         "dense": [("ptdp.parallel.tensor.transfers", name) for name in ("_all_reduce", "_all_gather", "_reduce_scatter")]}


class _Exposure:
    """This rank's expert exchanges: (inside an overlapped pair, modelled duration, time waited)."""

    def __init__(self) -> None:
        self.rows: list[tuple[bool, float, float]] = []
        self.local = threading.local()


def _install(latency: float, sequential: bool, exposure: _Exposure, part: str) -> None:
    """The benchmark's instruments, swapped into this process's modules: a latency floor and a timer on
    every timed exchange (``TIMED[part]``), a flag marking the pairs, and (``sequential``) pairs run one part
    after the other."""
    import importlib

    from ptdp.parallel.pipeline import module_stage

    class Timed:
        def __init__(self, works, issued: float, pair: bool) -> None:
            self.works, self.issued, self.pair = works, issued, pair

        def wait(self) -> tuple:
            t0 = time.perf_counter()
            result = self.works.wait()
            time.sleep(max(0.0, self.issued + latency - time.perf_counter()))
            done = time.perf_counter()
            exposure.rows.append((self.pair, done - self.issued, done - t0))
            return result

    def timer(real):
        def timed(*args, **kwargs):
            issued = time.perf_counter()
            return Timed(real(*args, **kwargs), issued, getattr(exposure.local, "pair", False))
        return timed

    for module, name in TIMED[part]:
        module = importlib.import_module(module)
        setattr(module, name, timer(getattr(module, name)))
    pair_method = module_stage.ModuleStage.forward_backward

    def flagged(self, *args, **kwargs):
        exposure.local.pair = True
        try:
            return pair_method(self, *args, **kwargs)
        finally:
            exposure.local.pair = False

    module_stage.ModuleStage.forward_backward = flagged
    if sequential:
        def one_after_the_other(forward, backward, context=None) -> None:
            forward.finish(context) if context is not None else forward.finish()
            backward.finish()

        module_stage.interleave = one_after_the_other


def _moe_worker(rank: int, world: int, store: str, argv: list[str], mode: str, latency: float, out: str,
                part: str = "moe") -> None:
    from ptdp.cli.main import build_parser
    from ptdp.config import config_from_args, derive
    from ptdp.train.loop import train

    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    exposure = _Exposure()
    _install(latency, mode == "sequential", exposure, part)
    try:
        metrics = f"{out}.metrics.jsonl"
        train(derive(config_from_args(build_parser().parse_args(["train", *argv, "--metrics-file", metrics]))))
        Path(f"{out}.{rank}.json").write_text(json.dumps(exposure.rows))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_now(0)  # not through the interpreter's teardown, which gloo's threads can abort (ptdp/runtime/exit.py)


def moe_part(args, part: str = "moe") -> dict:
    argv = [*(MOE_MODEL if part == "moe" else DENSE_MODEL), "--train-iters", str(args.iters)]
    world = 8 if part == "moe" else 4
    if args.delay_wgrad_compute:
        argv.append("--delay-wgrad-compute")
    if part == "dense" and args.sequence_parallel:
        argv.append("--sequence-parallel")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("overlapped", "sequential"):
            out = f"{tmp}/{mode}"
            mp.spawn(_moe_worker, args=(world, f"{tmp}/store-{mode}", argv, mode, args.latency_ms / 1e3, out, part),
                     nprocs=world)
            records = [json.loads(line) for line in Path(f"{out}.metrics.jsonl").read_text().splitlines()]
            rows = [row for r in range(world) for row in json.loads(Path(f"{out}.{r}.json").read_text())]
            results[mode] = {"iteration_s": statistics.median(r["iteration_time_s"] for r in records[1:]),
                             "loss": [r["loss"] for r in records], "rows": rows}
    over, seq = results["overlapped"], results["sequential"]
    assert over["loss"] == seq["loss"], "the interleaving changed the numbers"
    exposed = {k: sum(w for pair, _, w in results[k]["rows"]) for k in results}
    in_pairs = {k: sum(w for pair, _, w in results[k]["rows"] if pair) for k in results}
    comm = sum(d for _, d, _ in seq["rows"]) / world / args.iters  # per rank per iteration
    return {
        "latency_ms": args.latency_ms, "iterations": args.iters,
        "overlapped_iteration_s": over["iteration_s"], "sequential_iteration_s": seq["iteration_s"],
        "iteration_time_ratio": over["iteration_s"] / seq["iteration_s"],
        "all_to_all_share_of_sequential_step": comm / seq["iteration_s"],
        "hidden_share_in_pairs": 1 - in_pairs["overlapped"] / in_pairs["sequential"],
        "hidden_share_overall": 1 - exposed["overlapped"] / exposed["sequential"],
        "exchanges_per_rank_per_iteration": len(seq["rows"]) / world / args.iters,
    }


# ------------------------------------------------------------------------------ part 2: a sleep-timed pipeline


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, forward_s: float, backward_s: float) -> Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        time.sleep(ctx.backward_s)
        return grad.clone(), None, None


class _Timer:
    """An exchange taking ``seconds`` from its start, whatever the CPU does meanwhile."""

    def __init__(self, seconds: float, log: list, stage: SleepPieces) -> None:
        self.seconds, self.log, self.stage = seconds, log, stage

    def start(self, tensors: tuple) -> _Deadline:
        return _Deadline(time.perf_counter() + self.seconds, tuple(t.clone() for t in tensors), self.log,
                         self.stage.in_pair)

    def start_backward(self, grads: tuple) -> _Deadline:
        return self.start(grads)


class _Deadline:
    def __init__(self, deadline: float, result: tuple, log: list, pair: bool) -> None:
        self.deadline, self.result, self.log, self.pair = deadline, result, log, pair

    def wait(self) -> tuple:
        waited = max(0.0, self.deadline - time.perf_counter())
        time.sleep(waited)
        self.log.append((self.pair, waited))
        return self.result


class SleepPieces:
    """A ``PipelineStage`` whose chunks are MoE-like programs (per layer attention, route, dispatch, experts,
    combine, finish) of sleeping pieces and timed exchanges, run by the real engine; per chunk the pieces
    sleep t_F (forward) and t_B (input gradient), the weight gradient t_W after them."""

    def __init__(self, rank: int, p: int, args, comm_s: float, overlap: bool, placement: str) -> None:
        self.rank, self.p, self.placement, self.overlap = rank, p, placement, overlap
        self.t_f, self.t_b, self.t_w = args.t_f / 2, args.t_b / 2, args.t_w / 2  # per chunk of a V
        self.layers, self.comm_s = args.layers, comm_s
        self.losses: dict[int, Tensor] = {}
        self.waits: list[tuple[bool, float]] = []  # (inside a pair, time waited) per exchange
        self.in_pair = False
        self._runs: dict[tuple[int, int], tuple[ForwardRun, str]] = {}

    def parameters(self) -> list:
        return []

    def handlers(self) -> dict:
        return {}

    def _stage(self, chunk: int) -> int:
        return virtual_stage(self.rank, chunk, self.p, self.placement)

    def _program(self) -> list:
        pieces = 4 * self.layers
        f, b = self.t_f / pieces, self.t_b / pieces
        steps, value = [], "input"
        for layer in range(self.layers):
            for name in ("attention", "route", "dispatch", "experts", "combine", "finish"):
                out = f"{layer}.{name}"
                if name in ("dispatch", "combine"):
                    steps.append(Exchange(lambda _: _Timer(self.comm_s, self.waits, self), value, out, name))
                else:
                    steps.append(Compute(lambda t, f=f, b=b: ((_Sleep.apply(t[0], f, b),),), (value,), (out,), name))
                value = out
        return steps, value

    def _forward(self, chunk: int, microbatch: int, input: Tensor | None) -> ForwardRun:
        x = torch.zeros(4, requires_grad=True) if input is None else input.detach().requires_grad_(True)
        steps, out = self._program()
        run = ForwardRun(fuse(steps), {"input": (x,)})  # as ModuleStage
        self._runs[chunk, microbatch] = (run, out)
        return run

    def _send(self, chunk: int, run: ForwardRun, out: str) -> Tensor | None:
        return None if self._stage(chunk) == 2 * self.p - 1 else run.value(out)[0].detach()

    def _backward(self, chunk: int, microbatch: int) -> BackwardRun:
        run, out = self._runs.pop((chunk, microbatch))
        return BackwardRun(run, {out: (torch.ones(4),)})

    def _dx(self, chunk: int, back: BackwardRun) -> Tensor | None:
        return None if self._stage(chunk) == 0 else back.grad("input")[0]

    def forward(self, chunk: int, microbatch: int, input: Tensor | None) -> Tensor | None:
        run = self._forward(chunk, microbatch, input)
        run.finish()
        return self._send(chunk, run, self._runs[chunk, microbatch][1])

    def backward_input(self, chunk: int, microbatch: int, output_grad: Tensor | None) -> Tensor | None:
        back = self._backward(chunk, microbatch)
        back.finish()
        return self._dx(chunk, back)

    def backward(self, chunk: int, microbatch: int, output_grad: Tensor | None) -> Tensor | None:
        dx = self.backward_input(chunk, microbatch, output_grad)
        time.sleep(self.t_w)
        return dx

    def backward_weight(self, chunk: int, microbatch: int) -> None:
        time.sleep(self.t_w)

    def forward_backward(self, forward, input, backward, output_grad, saving):
        back = self._backward(backward.chunk, backward.microbatch)
        run = self._forward(forward.chunk, forward.microbatch, input)
        self.in_pair = True
        if self.overlap:
            interleave(run, back)
        else:
            run.finish()
            back.finish()
        self.in_pair = False
        if backward.op == "B":
            time.sleep(self.t_w)
        return self._send(forward.chunk, run, self._runs[forward.chunk, forward.microbatch][1]), \
            self._dx(backward.chunk, back)


def _exchange_s(args) -> float:
    """One exchange: ``--comm-fraction`` of a piece's forward + input-gradient sleep (4 pieces per layer, per
    chunk of a V); per chunk the 4 exchanges then cost that fraction of its F + B compute."""
    return args.comm_fraction * (args.t_f + args.t_b) / 2 / (4 * args.layers)


SLEEP_RUNS = [("dualpipev", True, False), ("zbv", True, False), ("dualpipev", True, True),
              ("dualpipev", False, True), ("zbv", True, True)]  # (schedule, overlap, with communication)


def _sleep_worker(rank: int, p: int, store: str, args, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=p,
                            timeout=timedelta(seconds=600))
    try:
        comm = P2PComm(list(range(p)), (4,))
        runs = []
        for name, overlap, with_comm in SLEEP_RUNS:
            stage = SleepPieces(rank, p, args, _exchange_s(args) if with_comm else 0.0, overlap,
                                schedule_placement(name))
            runs.append((stage, build_schedule(name, p, 2, args.m, rank), []))
        for _ in range(args.warmup + args.repeats):  # round robin: the machine's load falls on every run alike
            for stage, actions, times in runs:
                dist.barrier()
                t0 = time.perf_counter()
                run_schedule(actions, stage, comm, overlap_handlers(), count_saved_bytes=False)
                took = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                times.append(took.item())
        results = []
        for (name, overlap, with_comm), (stage, _, times) in zip(SLEEP_RUNS, runs, strict=True):
            waited = torch.tensor([sum(w for _, w in stage.waits), sum(w for pair, w in stage.waits if pair)])
            dist.all_reduce(waited, op=dist.ReduceOp.MAX)
            results.append((name, overlap, with_comm, statistics.median(times[args.warmup:]),
                            *(waited / (args.warmup + args.repeats)).tolist()))
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()
    exit_now(0)


def sleep_part(args) -> dict:
    p, m = args.p, args.m
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_sleep_worker, args=(p, f"{tmp}/store", args, f"{tmp}/out.json"), nprocs=p)
        rows = json.loads(Path(f"{tmp}/out.json").read_text())
    t = {(name, overlap, comm): (took, waited, in_pairs) for name, overlap, comm, took, waited, in_pairs in rows}
    work = m * (args.t_f + args.t_b + args.t_w)
    ideal = work * (1 + bubble_fraction_formula(p, 2, m, "dualpipev"))
    dpv, zbv = t["dualpipev", True, False][0], t["zbv", True, False][0]
    comm_per_exchange = _exchange_s(args)
    return {
        "p": p, "m": m, "t_f": args.t_f, "t_b": args.t_b, "t_w": args.t_w, "layers_per_chunk": args.layers,
        "dualpipev_s": dpv, "ideal_s": ideal, "dualpipev_over_ideal": dpv / ideal, "zbv_s": zbv,
        "dualpipev_over_zbv": dpv / zbv, "comm_per_exchange_s": comm_per_exchange,
        "with_comm": {f"{name}{'' if overlap else '-sequential'}": {"s": took, "over_ideal": took / ideal,
                                                                   "exposed_comm_s_per_rank": waited}
                      for (name, overlap, comm), (took, waited, _) in t.items() if comm},
        "hidden_share_in_pairs": 1 - t["dualpipev", True, True][2] / t["dualpipev", False, True][2],
        "hidden_share_overall": 1 - t["dualpipev", True, True][1] / t["dualpipev", False, True][1],
        "overlapped_over_sequential": t["dualpipev", True, True][0] / t["dualpipev", False, True][0],
    }


def _bad(message: str) -> int:
    print(f"benchmarks/dualpipe.py: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["moe", "dense", "sleep", "both"], default="both")
    parser.add_argument("--sequence-parallel", action="store_true", help="dense: with --sequence-parallel")
    parser.add_argument("--latency-ms", type=float, default=10.0, help="moe: each expert exchange's latency floor")
    parser.add_argument("--iters", type=int, default=4, help="moe: training iterations (the first is warm-up)")
    parser.add_argument("--delay-wgrad-compute", action="store_true", help="moe: with --delay-wgrad-compute")
    parser.add_argument("--p", type=int, default=4, help="sleep: pipeline size")
    parser.add_argument("--m", type=int, default=16, help="sleep: microbatches (>= 2p)")
    parser.add_argument("--layers", type=int, default=2, help="sleep: MoE layers per chunk")
    parser.add_argument("--t-f", type=float, default=0.02, help="sleep: forward seconds of a whole stage")
    parser.add_argument("--t-b", type=float, default=None, help="sleep: input-gradient seconds (default t_f)")
    parser.add_argument("--t-w", type=float, default=None, help="sleep: weight-gradient seconds (default t_f)")
    parser.add_argument("--comm-fraction", type=float, default=0.5,
                        help="sleep: an exchange's time over a piece's forward + backward compute")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.t_b = args.t_f if args.t_b is None else args.t_b
    args.t_w = args.t_f if args.t_w is None else args.t_w
    if args.p < 2 or args.m < 2 * args.p:
        return _bad(f"--m {args.m} must be at least 2 x --p {args.p} (dualpipev), with --p >= 2")
    if min(args.t_f, args.t_b, args.t_w) <= 0 or args.latency_ms < 0 or args.comm_fraction < 0 or args.iters < 2:
        return _bad("times must be > 0, --latency-ms and --comm-fraction >= 0, --iters >= 2")
    report = {}
    if args.part in ("moe", "both"):
        report["moe"] = moe_part(args)
    if args.part == "dense":
        report["dense"] = moe_part(args, "dense")
    if args.part in ("sleep", "both"):
        report["sleep"] = sleep_part(args)
    if args.json:
        print(json.dumps(report))
        return 0
    if "moe" in report:
        r = report["moe"]
        print(f"MoE, dualpipev p=2 e=4 (8 gloo processes), all-to-all latency floor {r['latency_ms']:.0f} ms, "
              f"{r['exchanges_per_rank_per_iteration']:.0f} exchanges per rank per iteration")
        print(f"  all-to-all share of the sequential step   {r['all_to_all_share_of_sequential_step']:.1%}")
        print(f"  all-to-all hidden, inside the pairs        {r['hidden_share_in_pairs']:.1%}  (goal >= 70%: "
              f"{'met' if r['hidden_share_in_pairs'] >= 0.7 else 'NOT met'})")
        print(f"  all-to-all hidden, over the whole step     {r['hidden_share_overall']:.1%}")
        print(f"  iteration time overlapped / sequential     {r['iteration_time_ratio']:.3f} "
              f"({r['overlapped_iteration_s']:.3f} s / {r['sequential_iteration_s']:.3f} s)")
    if "dense" in report:
        r = report["dense"]
        what = "all-gathers/reduce-scatters" if args.sequence_parallel else "all-reduces"
        print(f"dense, dualpipev p=2 t=2{' SP' if args.sequence_parallel else ''} (4 gloo processes), tensor-parallel "
              f"{what} with a latency floor {r['latency_ms']:.0f} ms, "
              f"{r['exchanges_per_rank_per_iteration']:.0f} timed exchanges per rank per iteration")
        print(f"  TP collective share of the sequential step {r['all_to_all_share_of_sequential_step']:.1%}")
        print(f"  TP collectives hidden, inside the pairs    {r['hidden_share_in_pairs']:.1%}")
        print(f"  TP collectives hidden, over the whole step {r['hidden_share_overall']:.1%}")
        print(f"  iteration time overlapped / sequential     {r['iteration_time_ratio']:.3f} "
              f"({r['overlapped_iteration_s']:.3f} s / {r['sequential_iteration_s']:.3f} s)")
    if "sleep" in report:
        r = report["sleep"]
        print(f"sleep-timed pipeline p={r['p']} m={r['m']}, t_F={r['t_f'] * 1e3:.0f}ms t_B={r['t_b'] * 1e3:.0f}ms "
              f"t_W={r['t_w'] * 1e3:.0f}ms per stage, {r['layers_per_chunk']} MoE-like layers per chunk")
        print(f"  dualpipev / ideal {r['dualpipev_over_ideal']:.3f} (goal <= 1.05: "
              f"{'met' if r['dualpipev_over_ideal'] <= 1.05 else 'NOT met'}); dualpipev / zbv {r['dualpipev_over_zbv']:.3f}")
        print(f"  with an exchange of {r['comm_per_exchange_s'] * 1e3:.1f} ms each (dispatch and combine, both ways):")
        for name, row in r["with_comm"].items():
            print(f"    {name:<22} {row['s']:.3f} s  over ideal {row['over_ideal']:.3f}  "
                  f"exposed communication per rank {row['exposed_comm_s_per_rank']:.3f} s")
        print(f"  hidden by the overlap: {r['hidden_share_in_pairs']:.1%} inside the pairs, "
              f"{r['hidden_share_overall']:.1%} overall; overlapped / sequential {r['overlapped_over_sequential']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
