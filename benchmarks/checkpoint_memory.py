"""Memory a checkpoint save costs each rank with the distributed optimizer (shard-by-shard saves).

    python benchmarks/checkpoint_memory.py [--json]                        # this tree
    python benchmarks/checkpoint_memory.py --strategy optim_grads_params   # ZeRO-3: the weights are pieces too
    PYTHONPATH=/path/to/older/ptdp python benchmarks/checkpoint_memory.py  # the same script, another tree

Four CPU processes (d = 4, ``--use-distributed-optimizer``, fp32) build a GPT of about 25M parameters,
train one iteration (so Adam has state), then each rank resets its peak resident set (``echo 5 >
/proc/self/clear_refs``), saves a checkpoint, and reports ``VmHWM - VmRSS before the save``: the memory
the save added on that rank. The processes run with ``MALLOC_MMAP_THRESHOLD_`` at 128 KiB, so freed
tensors go back to the system and the peak is the real high-water mark rather than malloc's reuse of
old pages. Then every rank loads it back the same way. Printed beside it: this rank's model states
(``model_state_bytes``) and the 12 bytes per parameter that a full fp32 master + Adam copy costs -- what
the first version of the save gathered onto every rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ptdp.runtime.exit import exit_now

WORLD = 4
MODEL = ["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "32",
         "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "1", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--use-distributed-optimizer"]


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _measure(fn) -> tuple[int, float]:
    dist.barrier()
    before = _status("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return _status("VmHWM") - before, time.perf_counter() - start


def _worker(rank: int, store: str, workdir: str, out: str, strategy: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    from ptdp.checkpointing import load_checkpoint, save_checkpoint
    from ptdp.cli.main import build_parser
    from ptdp.config import config_from_args, derive
    from ptdp.optim.memory import model_state_bytes
    from ptdp.train.state import setup
    from ptdp.train.step import train_step

    ckpt = str(Path(workdir) / "ckpt")
    config = derive(config_from_args(build_parser().parse_args(
        ["train", *MODEL, "--save", ckpt, *([] if strategy == "optim" else ["--data-parallel-sharding-strategy",
                                                                             strategy])])))
    trainer = setup(config)
    train_step(trainer, 1)
    states = model_state_bytes(trainer.params, trainer.grads, trainer.optimizer)["total"]
    params = sum(p.numel() for p in trainer.params)
    save_extra, save_s = _measure(lambda: save_checkpoint(trainer, 1))
    load_extra, load_s = _measure(lambda: load_checkpoint(trainer, ckpt))
    row = {"rank": rank, "params": params, "model_state_bytes": states, "save_extra_bytes": save_extra,
           "load_extra_bytes": load_extra, "save_s": round(save_s, 2), "load_s": round(load_s, 2)}
    rows: list = [None] * WORLD
    dist.all_gather_object(rows, row)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()
    exit_now(0)  # not through the interpreter's teardown, which gloo's threads can abort (ptdp/runtime/exit.py)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--strategy", default="optim", help="--data-parallel-sharding-strategy (default optim)")
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        mp.start_processes(_worker, args=(str(Path(tmp) / "store"), tmp, out, args.strategy), nprocs=WORLD, start_method="spawn")
        rows = json.loads(Path(out).read_text())
    params = rows[0]["params"]
    full = 12 * params  # fp32 master weights + two Adam moments of every parameter
    result = {
        "ptdp": str(Path(sys.modules.get("ptdp").__file__).parent) if "ptdp" in sys.modules else
        os.environ.get("PYTHONPATH", ""),
        "strategy": args.strategy,
        "parameters": params,
        "model_state_bytes_max": max(r["model_state_bytes"] for r in rows),
        "full_optimizer_copy_bytes": full,
        "save_extra_bytes_max": max(r["save_extra_bytes"] for r in rows),
        "load_extra_bytes_max": max(r["load_extra_bytes"] for r in rows),
        "save_extra_over_full_copy": round(max(r["save_extra_bytes"] for r in rows) / full, 3),
        "save_s_max": max(r["save_s"] for r in rows),
        "per_rank": rows,
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    mb = 2**20
    print(f"GPT {params / 1e6:.1f}M parameters, d={WORLD}, fp32, {args.strategy}; ptdp from "
          f"{os.environ.get('PYTHONPATH') or 'the installed package'}")
    print(f"model states on the fullest rank: {result['model_state_bytes_max'] / mb:.0f} MiB; a full fp32 master + "
          f"Adam copy: {full / mb:.0f} MiB")
    for r in rows:
        print(f"  rank {r['rank']}: save +{r['save_extra_bytes'] / mb:.0f} MiB ({r['save_s']} s), "
              f"load +{r['load_extra_bytes'] / mb:.0f} MiB ({r['load_s']} s)")
    print(f"worst save: +{result['save_extra_bytes_max'] / mb:.0f} MiB = {result['save_extra_over_full_copy']:.2f}x "
          "a full optimizer copy")


if __name__ == "__main__":
    main()
