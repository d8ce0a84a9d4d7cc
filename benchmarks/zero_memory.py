"""ZeRO-1's memory: model-state bytes and peak memory per rank, with and without
``--use-distributed-optimizer``, measured in the same run, against ZeRO's/Megatron's formulas.

Each case trains a GPT for a few iterations with ``ptdp train`` on d = 4 CPU processes (t = p = 1) and
reads the last metrics record: ``model_state_bytes_per_rank`` (distinct storages of parameters,
gradient buffers, main parameters and Adam state, counted from the tensors held: ptdp/optim/memory.py),
``peak_resident_bytes_per_rank`` (each worker's VmHWM) and, on a GPU, ``peak_allocated_bytes_per_rank``
(``torch.cuda.max_memory_allocated``). The formula is 16 -> 8 + 8/d bytes per parameter in fp32 and
18 -> 6 + 12/d with ``--bf16`` (docs/references.md, §Memory); the Adam saving is the difference, and the
goal is that peak resident memory falls by at least 80% of it.

    python benchmarks/zero_memory.py                 # a 25M-parameter GPT (fast on a small CPU box)
    python benchmarks/zero_memory.py --model 85m     # the reference 85M GPT (12 layers, hidden 768)
    python benchmarks/zero_memory.py --bf16 --json
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

import torch

from ptdp.config import ModelConfig
from ptdp.data.tokenizer import ByteTokenizer
from ptdp.models.flops import model_parameter_count
from ptdp.optim.memory import model_state_formula_bytes

MODELS = {
    "25m": {"num_layers": 8, "hidden_size": 512, "num_attention_heads": 8, "seq_length": 64},
    "85m": {"num_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "seq_length": 64},
}
WORLD, ITERS = 4, 4


def parameters(model: dict) -> int:
    cfg = ModelConfig(**model)
    return model_parameter_count(cfg, cfg.padded_vocab_size(ByteTokenizer.vocab_size, 1)) + 2 * cfg.hidden_size


def measure(model: dict, zero: bool, bf16: bool, workdir: Path) -> dict:
    metrics = workdir / f"metrics-{os.urandom(4).hex()}.jsonl"
    args = [f"--{k.replace('_', '-')}={v}" for k, v in model.items()]
    cmd = [sys.executable, "-m", "ptdp", "train", *args, "--micro-batch-size", "4", "--global-batch-size", "16",
           "--train-iters", str(ITERS), "--hidden-dropout", "0", "--attention-dropout", "0",
           "--nproc-per-node", str(WORLD), "--metrics-file", str(metrics),
           *(["--use-distributed-optimizer"] if zero else []), *(["--bf16"] if bf16 else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise SystemExit(f"zero_memory.py: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    last = records[-1]
    return {
        "model_state_bytes_per_rank": last["model_state_bytes_per_rank"],
        "peak_resident_bytes_per_rank": last["peak_resident_bytes_per_rank"],
        "peak_allocated_bytes_per_rank": last["peak_allocated_bytes_per_rank"],
        "iteration_time_s": statistics.median(r["iteration_time_s"] for r in records[1:]),
        "losses": [r["loss"] for r in records],
        "grad_norms": [r["grad_norm"] for r in records],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="25m")
    parser.add_argument("--bf16", action="store_true", help="bf16 parameters, fp32 gradients (18 -> 6 + 12/d)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    model, n = MODELS[args.model], parameters(MODELS[args.model])
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: measure(model, zero, args.bf16, Path(tmp))
                for name, zero in (("baseline", False), ("distributed_optimizer", True))}
    for name, run in runs.items():
        run["formula_bytes"] = int(model_state_formula_bytes(n, dtype, torch.float32, WORLD,
                                                             name == "distributed_optimizer"))
        run["model_state_over_formula"] = round(max(run["model_state_bytes_per_rank"]) / run["formula_bytes"], 4)
    base, zero = runs["baseline"], runs["distributed_optimizer"]
    adam_saving = base["formula_bytes"] - zero["formula_bytes"]
    resident_saving = min(a - b for a, b in zip(base["peak_resident_bytes_per_rank"],
                                                 zero["peak_resident_bytes_per_rank"], strict=True))
    summary = {
        "model": args.model, "parameters": n, "d": WORLD, "dtype": str(dtype).removeprefix("torch."),
        "runs": runs, "formula_saving_bytes": adam_saving,
        "measured_model_state_saving_bytes": max(base["model_state_bytes_per_rank"])
        - max(zero["model_state_bytes_per_rank"]),
        "peak_resident_saving_bytes_min_over_ranks": resident_saving,
        "peak_resident_saving_over_formula": round(resident_saving / adam_saving, 3),
        **{f"max_rel_diff_{key}": max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(base[key], zero[key], strict=True))
           for key in ("losses", "grad_norms")},
    }
    if base["peak_allocated_bytes_per_rank"]:
        summary["peak_allocated_saving_bytes_min_over_ranks"] = min(
            a - b for a, b in zip(base["peak_allocated_bytes_per_rank"], zero["peak_allocated_bytes_per_rank"],
                                  strict=True))
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    mb = 2**20
    print(f"GPT {args.model} ({n / 1e6:.2f}M parameters), d={WORLD}, {summary['dtype']}, {ITERS} iterations")
    print(f"{'case':22s} {'model states MiB (per rank)':>32s} {'formula MiB':>12s} {'peak RSS MiB (per rank)':>30s} "
          f"{'iter s':>7s}")
    for name, run in runs.items():
        states = "/".join(f"{v / mb:.1f}" for v in run["model_state_bytes_per_rank"])
        peaks = "/".join(f"{v / mb:.0f}" for v in run["peak_resident_bytes_per_rank"])
        print(f"{name:22s} {states:>32s} {run['formula_bytes'] / mb:12.1f} {peaks:>30s} "
              f"{run['iteration_time_s']:7.3f}")
    print(f"Adam saving by the formula: {adam_saving / mb:.1f} MiB; model states measured: "
          f"{summary['measured_model_state_saving_bytes'] / mb:.1f} MiB; peak RSS (worst rank): "
          f"{resident_saving / mb:.1f} MiB = {summary['peak_resident_saving_over_formula']:.0%} of it; "
          f"losses / grad norms against the baseline within {summary['max_rel_diff_losses']:.1e} / "
          f"{summary['max_rel_diff_grad_norms']:.1e} (relative)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
