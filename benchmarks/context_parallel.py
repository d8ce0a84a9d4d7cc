"""Micro-benchmark of the context-parallel attention kernels (forward + backward) on gloo CPU processes.

    python benchmarks/context_parallel.py --cp 2 --seq 1024            # one JSON line per comm type
    python benchmarks/context_parallel.py --cp 4 --seq 2048 --repeats 5

Each of c processes (one thread each) runs ``context_parallel_attention`` on its s/c tokens for every
``--cp-comm-type``; the reported time is the median over repeats of the slowest rank, beside one process
running causal SDPA over the whole sequence. On a shared or loaded machine the times mean little; the
end-to-end memory-vs-s benchmark is benchmarks/memory.py.
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
import torch.nn.functional as F

from ptdp.parallel.context.attention import COMM_TYPES, context_parallel_attention, shard_sequence
from ptdp.runtime.exit import exit_now


def _time(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times[1:]


def _inputs(args) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(args.batch, args.heads, args.seq, args.head_dim, generator=g) for _ in range(4)]


def _rank(rank: int, args, store: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.cp)
    c = args.cp
    q, k, v, dout = (shard_sequence(t, c, rank, dim=2) for t in _inputs(args))
    result = {}
    for comm_type in COMM_TYPES:
        if comm_type == "a2a" and args.heads % c:
            continue
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]

        def step(leaves=leaves, comm_type=comm_type):
            dist.barrier()
            context_parallel_attention(*leaves, cp_group=dist.group.WORLD, comm_type=comm_type).backward(dout)

        times = torch.tensor(_time(step, args.repeats))
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        result[comm_type] = statistics.median(times.tolist())
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()
    exit_now(0)  # not through the interpreter's teardown, which gloo's threads can abort (ptdp/runtime/exit.py)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    q, k, v, dout = _inputs(args)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    single = statistics.median(_time(
        lambda: F.scaled_dot_product_attention(*leaves, is_causal=True).backward(dout), args.repeats))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(_rank, args=(args, os.path.join(tmp, "store"), out), nprocs=args.cp,
                           start_method="spawn")
        with open(out) as f:
            result = json.load(f)
    common = {"cp": args.cp, "seq": args.seq, "batch": args.batch, "heads": args.heads, "head_dim": args.head_dim,
              "single_process_sdpa_s": round(single, 4)}
    for comm_type, seconds in result.items():
        print(json.dumps({**common, "cp_comm_type": comm_type, "fwd_bwd_s": round(seconds, 4)}))


if __name__ == "__main__":
    main()
