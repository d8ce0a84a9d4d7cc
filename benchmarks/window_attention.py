"""A sliding-window layer against full causal attention as the sequence grows at a fixed window: the forward +
backward time of the attention core per token, and the bytes a context-parallel rank sends per layer.

    python benchmarks/window_attention.py --json                         # s = 1k..16k, w = 256, c = 1, 2, 4
    python benchmarks/window_attention.py --seqs 1024 4096 --cp 1 2 --repeats 3

For each s and c, one process per CP rank (one thread each, gloo) runs ``context_parallel_attention`` on its
s/c tokens twice: with ``window=w`` (c = 1: the tiled core ``ptdp.models.window``; c > 1: the windowed
exchange of ``ptdp.parallel.context.window``) and without (c = 1: causal SDPA, c > 1: the causal ring), each
``--cp-comm-type p2p``. Reported: the median over repeats of the slowest rank's time, per token of the rank
(µs; wall time and the process's CPU time, the steadier of the two on a shared machine), and the bytes rank 0
sends in one forward + backward (every ``batch_isend_irecv`` send counted). A windowed layer's time per token
should stay flat in s and its bytes constant; full attention's grow with s. The bytes are exact.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ptdp.parallel.context.attention import context_parallel_attention, shard_sequence
from ptdp.runtime.exit import exit_now


def _inputs(args, s: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, args.heads, s, args.head_dim, generator=g) for _ in range(4)]


def _measure(args, s: int, c: int, rank: int, group) -> dict:
    q, k, v, dout = (shard_sequence(t, c, rank, dim=2) for t in _inputs(args, s))
    sent = [0]
    real = dist.batch_isend_irecv

    def counting(ops):  # the bytes this rank sends
        sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return real(ops)

    result = {}
    for name, window in (("window", args.window), ("full", None)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        times = []
        for i in range(args.repeats + 1):  # the first is a warm-up
            if group is not None:
                dist.barrier(group)
            sent[0] = 0
            dist.batch_isend_irecv = counting
            start, cpu = time.perf_counter(), time.process_time()
            context_parallel_attention(*leaves, cp_group=group, comm_type="p2p", window=window).backward(dout)
            elapsed = (time.perf_counter() - start, time.process_time() - cpu)
            dist.batch_isend_irecv = real
            if i:
                times.append(elapsed)
        seconds = torch.tensor([statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)])
        if group is not None:
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)  # the slowest rank sets the pace
        result[name] = {"us_per_token": round(1e6 * seconds[0].item() / (s // c), 3),
                        "cpu_us_per_token": round(1e6 * seconds[1].item() / (s // c), 3), "bytes_sent": sent[0]}
    return result


def _rank(rank: int, args, s: int, c: int, store: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=c)
    result = _measure(args, s, c, rank, dist.group.WORLD)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()
    exit_now(0)  # not through the interpreter's teardown, which gloo's threads can abort (ptdp/runtime/exit.py)


def run(args, s: int, c: int) -> dict:
    if c == 1:
        torch.set_num_threads(1)
        return _measure(args, s, 1, 0, None)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(_rank, args=(args, s, c, os.path.join(tmp, "store"), out), nprocs=c, start_method="spawn")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="one JSON object for the whole run")
    args = parser.parse_args()
    rows = []
    for c in args.cp:
        base = None
        for s in args.seqs:
            result = run(args, s, c)
            base = base or result
            row = {"cp": c, "seq": s, "window": args.window,
                   **{f"{k}_{m}": v[m] for k, v in result.items() for m in ("us_per_token", "cpu_us_per_token",
                                                                            "bytes_sent")},
                   # CPU time against the shortest sequence of the same c: flat for the window, growing for full
                   "window_cpu_vs_first": round(result["window"]["cpu_us_per_token"]
                                                / base["window"]["cpu_us_per_token"], 2),
                   "full_cpu_vs_first": round(result["full"]["cpu_us_per_token"] / base["full"]["cpu_us_per_token"], 2)}
            rows.append(row)
            if not args.json:
                print(json.dumps(row), flush=True)
    if args.json:
        print(json.dumps({"heads": args.heads, "head_dim": args.head_dim, "window": args.window, "rows": rows}))


if __name__ == "__main__":
    main()
