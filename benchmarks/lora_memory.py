"""LoRA's memory: model-state bytes per rank of full fine-tuning against LoRA (rank 8 and 16), from the
formulas on a preset shape and measured on the CPU model in the same run.

Full fine-tuning keeps, per parameter, the weight, its gradient and the optimizer's share (bf16: 2 + 4 + 12
bytes, the 12 sharded over d with ``--use-distributed-optimizer``: docs/references.md, §Memory and §ZeRO).
LoRA keeps the frozen weights (2 bytes each in bf16; sharded over d only under ZeRO-3: docs/lora.md) and the
full 18 bytes only for the adapters: per adapted linear r·(in + out) parameters, of which a tensor-parallel rank holds its
piece (column-parallel linears: A whole, B split; row-parallel: A split, B whole).

The measured part trains a small Llama-shaped GPT for a few iterations in one CPU process (fp32: 4 + 4 + 8
bytes per trained parameter) and reads ``model_state_bytes_per_rank`` from the metrics (distinct storages
of parameters, gradient buffers and optimizer state, counted from the tensors held: ptdp/optim/memory.py).

    python benchmarks/lora_memory.py                 # llama3-8b's formulas, t = 8, d = 8; a 6-layer CPU model
    python benchmarks/lora_memory.py --preset llama2-7b --t 1 --d 8 --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ptdp.planner.memory import model_state_bytes_per_param, parameters_per_rank
from ptdp.planner.spec import MODEL_PRESETS, GPTSpec

RANKS = (8, 16)
CPU_MODEL = ["--num-layers", "6", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "64",
             "--ffn-hidden-size", "704", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
             "--disable-bias-linear", "--group-query-attention", "--num-query-groups", "2",
             "--untie-embeddings-and-output-weights"]


def adapter_parameters_per_rank(model: GPTSpec, r: int, t: int) -> float:
    """One rank's adapter parameters (every layer, all four targets: QKV, proj, fc1, fc2) at tensor size t."""
    h, f = model.hidden_size, model.ffn
    qkv_out, fc1_out = model.q_width + 2 * model.kv_width, (2 if model.swiglu else 1) * f
    column = r * h + r * qkv_out / t + r * h + r * fc1_out / t  # A whole, B split
    row = r * model.q_width / t + r * h + r * f / t + r * h  # A split, B whole
    return model.num_layers * (column + row)


def formulas(preset: str, t: int, d: int) -> dict:
    model = MODEL_PRESETS[preset]
    params = parameters_per_rank(model, t, 1, 0)
    full = params * model_state_bytes_per_param("bf16", "optim", d)
    out = {"preset": preset, "t": t, "d": d, "parameters_per_rank": params, "full": full}
    for r in RANKS:
        adapters = adapter_parameters_per_rank(model, r, t)
        out[f"lora_r{r}"] = params * 2 + adapters * model_state_bytes_per_param("bf16", "optim", d)
        out[f"lora_r{r}_adapters"] = adapters
        # ZeRO-3 shards the frozen weights too (docs/lora.md): 2/d per frozen weight, 18/d per adapter one
        out[f"lora_r{r}_zero3"] = params * 2 / d + adapters * model_state_bytes_per_param("bf16", "optim_grads_params", d)
    out["full_zero3"] = params * model_state_bytes_per_param("bf16", "optim_grads_params", d)
    return out


def measure(extra: list[str], workdir: Path) -> int:
    metrics = workdir / f"metrics-{os.urandom(4).hex()}.jsonl"
    cmd = [sys.executable, "-m", "ptdp", "train", *CPU_MODEL, "--micro-batch-size", "2", "--global-batch-size", "4",
           "--train-iters", "2", "--hidden-dropout", "0", "--attention-dropout", "0", "--metrics-file", str(metrics),
           *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise SystemExit(f"lora_memory.py: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    last = json.loads(metrics.read_text().splitlines()[-1])
    return max(last["model_state_bytes_per_rank"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama3-8b", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--t", type=int, default=8)
    parser.add_argument("--d", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    planned = formulas(args.preset, args.t, args.d)
    with tempfile.TemporaryDirectory() as tmp:
        measured = {"full": measure([], Path(tmp))}
        measured.update({f"lora_r{r}": measure(["--lora-rank", str(r)], Path(tmp)) for r in RANKS})
    if args.json:
        print(json.dumps({"formulas": planned, "measured_cpu_fp32": measured}, indent=2))
        return 0
    gib = 1024**3
    print(f"{args.preset}, bf16, t={args.t}, d={args.d}, ZeRO-1 (formulas): model states per rank "
          f"({planned['parameters_per_rank'] / 1e6:.0f}M parameters)")
    print(f"  full fine-tuning {planned['full'] / gib:8.2f} GiB")
    for r in RANKS:
        print(f"  LoRA r={r:<2}        {planned[f'lora_r{r}'] / gib:8.2f} GiB  ({planned[f'lora_r{r}'] / planned['full']:.3f}x; "
              f"{planned[f'lora_r{r}_adapters'] / 1e6:.2f}M adapter parameters per rank)")
    print(f"  ZeRO-3 instead: full fine-tuning {planned['full_zero3'] / gib:.2f} GiB, "
          + ", ".join(f"LoRA r={r} {planned[f'lora_r{r}_zero3'] / gib:.2f} GiB" for r in RANKS))
    print("CPU model (6 layers, h=256, fp32, one process, measured from the tensors held):")
    print(f"  full fine-tuning {measured['full'] / 2**20:8.2f} MiB")
    for r in RANKS:
        print(f"  LoRA r={r:<2}        {measured[f'lora_r{r}'] / 2**20:8.2f} MiB  "
              f"({measured[f'lora_r{r}'] / measured['full']:.3f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
