"""``ptdp plan``'s search: the branch and bound (``ptdp.planner.bound``) against pricing every layout.

    python benchmarks/plan_speed.py                  # the README's Mixtral-8x7B on 64 H100s (minutes: the baseline)
    python benchmarks/plan_speed.py --model llama3-70b --gpus 512 --json

Both searches run in this process on the same space, the exhaustive one (``search(configs=candidates(...))``,
what ``ptdp plan`` did before the branch and bound) first. Printed: wall and CPU seconds of each, their ratio, the
layouts each estimated, and whether the answers (the best layout and the runners-up, every field of
``--json``) are identical. CPU seconds are the figure to compare on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from ptdp.config.presets import PLAN_GLOBAL_BATCH
from ptdp.planner.search import candidates, search
from ptdp.planner.spec import MODEL_PRESETS, ClusterSpec, TrainingSpec


def _timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def _answer(result) -> list[dict]:
    return [r.to_dict() for r in ([result.best] if result.best else []) + result.runners_up]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mixtral-8x7b", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--gpu", default="h100-80gb")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--global-batch-size", type=int, default=None, help="default: the preset's, or 256")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model, cluster = MODEL_PRESETS[args.model], ClusterSpec.of(args.gpu, args.gpus)
    train = TrainingSpec(args.global_batch_size or PLAN_GLOBAL_BATCH.get(args.model, 256), args.precision)
    full, full_wall, full_cpu = _timed(lambda: search(model, cluster, train, configs=candidates(model, cluster, train)))
    fast, fast_wall, fast_cpu = _timed(lambda: search(model, cluster, train))
    out = {
        "command": f"ptdp plan --model {args.model} --gpus {args.gpus} --gpu {args.gpu}"
                   f"{' --bf16' if args.precision == 'bf16' else ''} --global-batch-size {train.global_batch_size}",
        "every_layout": {"wall_s": full_wall, "cpu_s": full_cpu, "layouts_estimated": full.num_evaluated},
        "branch_and_bound": {"wall_s": fast_wall, "cpu_s": fast_cpu, "layouts_estimated": fast.num_evaluated},
        "cpu_speedup": full_cpu / fast_cpu,
        "same_answer": _answer(full) == _answer(fast),
        "machine": f"{platform.processor() or platform.machine()}, python {platform.python_version()}",
    }
    if args.json:
        print(json.dumps(out))
        return
    print(out["command"])
    for name in ("every_layout", "branch_and_bound"):
        r = out[name]
        print(f"{name:17s} {r['wall_s']:8.1f} s wall {r['cpu_s']:8.1f} s CPU  {r['layouts_estimated']:>8,} layouts")
    print(f"CPU time ratio {out['cpu_speedup']:.1f}x; same answer: {out['same_answer']}")


if __name__ == "__main__":
    main()
