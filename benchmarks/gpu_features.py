"""The GPU-readiness numbers in one run: bf16 MFU of the 1.3B GPT and the Llama-style 1.2B, FP8 over bf16,
and ``--optimizer-cpu-offload``'s memory saved and time cost.

    python benchmarks/gpu_features.py --json            # one JSON object on stdout
    python benchmarks/gpu_features.py --curve 200       # FP8 vs bf16 loss curves of 200 iterations

Every case is one ``benchmarks/gpu.py --json`` subprocess (a fresh process: no memory or compiled code
carried between cases), all on the same GPU in the same run, so each ratio is against a baseline measured
beside it:

* ``gpt-1.3b`` (with the plain PyTorch loop) and ``llama-1b``: MFU and tokens/s in bf16;
* ``fp8``: the same GPT with ``--fp8-format`` (default hybrid, tensorwise): ``fp8_tokens_per_s_over_bf16``
  (goal >= 1.25) and, over ``--curve`` iterations from the same start, the relative gap between the two
  loss curves' last-10% means (goal <= 0.01);
* ``offload``: the same GPT with ``--optimizer-cpu-offload``: ``offload_memory_saved_gib`` (peak) and
  ``offload_time_ratio`` (iteration time over on-device Adam).

Without a CUDA device it prints one line and exits 0. FP8 needs torchao and a GPU of compute capability
>= 8.9; without them the FP8 case is reported as skipped, with ptdp's one-line reason.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_case(extra: list[str], common: list[str]) -> dict:
    """One ``gpu.py --json`` run; {"error": line} when it failed."""
    command = [sys.executable, str(HERE / "gpu.py"), "--json", *common, *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        return {"error": tail[-1] if tail else f"exit {proc.returncode}", "command": " ".join(command)}
    return json.loads(lines[-1])


def tail_mean(curve: list[float]) -> float:
    k = max(1, len(curve) // 10)
    return sum(curve[-k:]) / k


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--curve", type=int, default=200, help="loss-curve iterations for bf16 vs FP8 (0: none)")
    parser.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default="hybrid")
    parser.add_argument("--fp8-recipe", choices=["tensorwise", "rowwise"], default="tensorwise")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("benchmarks/gpu_features.py: no CUDA device here; nothing measured (run it on a GPU machine)")
        return 0
    common = ["--iters", str(args.iters)]
    curve = ["--loss-curve", str(args.curve)] if args.curve else []
    cases = {
        "gpt-1.3b": run_case(curve, common),
        "llama-1b": run_case(["--model", "llama-1b"], common),
        "fp8": run_case(["--skip-plain", "--fp8-format", args.fp8_format, "--fp8-recipe", args.fp8_recipe, *curve],
                        common),
        "offload": run_case(["--skip-plain", "--optimizer-cpu-offload"], common),
    }
    base, fp8, offload = cases["gpt-1.3b"], cases["fp8"], cases["offload"]
    out: dict = {"benchmark": "gpu_features", "device": torch.cuda.get_device_name(), "cases": cases}
    ok = "error" not in base
    out["gpt_mfu"] = base.get("mfu")
    out["gpt_time_over_plain_pytorch"] = base.get("time_over_plain_pytorch")
    out["llama_mfu"] = cases["llama-1b"].get("mfu")
    if ok and "error" not in fp8:
        out["fp8_tokens_per_s_over_bf16"] = fp8["tokens_per_s"] / base["tokens_per_s"]
        if args.curve:
            b, f = tail_mean(base["ptdp"]["loss_curve"]), tail_mean(fp8["ptdp"]["loss_curve"])
            out["fp8_loss_gap"] = abs(f - b) / b
    if ok and "error" not in offload:
        out["offload_memory_saved_gib"] = base["peak_memory_gib"] - offload["peak_memory_gib"]
        out["offload_time_ratio"] = offload["ptdp"]["iteration_s"] / base["ptdp"]["iteration_s"]
    out["goals"] = {"gpt_mfu": 0.55, "gpt_time_over_plain_pytorch": 1.0, "fp8_tokens_per_s_over_bf16": 1.25,
                    "fp8_loss_gap": 0.01}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{out['device']}:")
    for key in ("gpt_mfu", "gpt_time_over_plain_pytorch", "llama_mfu", "fp8_tokens_per_s_over_bf16", "fp8_loss_gap",
                "offload_memory_saved_gib", "offload_time_ratio"):
        value = out.get(key)
        goal = out["goals"].get(key)
        print(f"  {key:32s} {value if value is None else f'{value:.4f}'}" + (f"  (goal {goal})" if goal else ""))
    for name, case in cases.items():
        if "error" in case:
            print(f"  {name}: not measured: {case['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
