"""ptdp on one GPU: model FLOPs utilisation of a 1.3B GPT, against a plain PyTorch loop and the planner.

    python benchmarks/gpu.py --json                 # one JSON object on stdout
    python benchmarks/gpu.py --iters 10 --micro-batch-size 8
    python benchmarks/gpu.py --json --model llama-1b                        # the Llama-style 1.2B
    python benchmarks/gpu.py --json --skip-plain --fp8-format hybrid        # FP8 (torchao), or
    python benchmarks/gpu.py --json --skip-plain --optimizer-cpu-offload    # Adam on the host
    python benchmarks/gpu.py --json --skip-plain --loss-curve 200           # + 200 iterations' losses

``benchmarks/gpu_suite.py`` runs these (and the rest of the GPU checks) in one prepared run;
``benchmarks/gpu_features.py`` runs the FP8 / CPU-offload / MFU subset. :func:`measure` is what both call.

The GPT-3 1.3B shape (24 layers, h=2048, 16 heads, s=2048, V=50257) in bf16 with the best single-device
settings: flash SDPA, fused AdamW, ``--compile`` (each transformer layer compiled), dropout off. It is
trained for ``--warmup`` + ``--iters`` iterations by ptdp's own step (``ptdp.train.state.setup`` and
``train_step`` at t = p = d = 1: pipeline executor, gradient buffers, bf16 optimizer with fp32 main
weights and grads, device-side clipping) and by :func:`plain_step`, a plain PyTorch loop of the same
model written below with no ptdp code. Reported: ``mfu`` (model FLOPs, no recomputation, over the GPU's
dense bf16 peak, 989 TFLOP/s on an H100 SXM), ``tflops_per_gpu`` (the paper's eq. 3), tokens/s and peak
memory of each, ``time_over_plain_pytorch`` (goals: MFU >= 0.50, ratio <= 1.02), and ``ptdp plan``'s
estimate for the same case beside the measurement. ``--model llama-1b``: Llama 3.2 1B's shape against
``overhead.PlainLlama`` (RoPE, RMSNorm, SwiGLU, GQA; tied here, as Llama 3.2 1B is). Without a CUDA device
it prints one line and exits 0; ``--device cpu`` runs it anyway, for toy-sized dry runs only.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from overhead import PlainGPT, PlainLlama  # the same plain models as the CPU overhead benchmark
from torch import nn

# --------------------------------------------------------------------------------------- plain PyTorch
# What a careful PyTorch user writes (nanoGPT-style, overhead.PlainGPT) with the same kernels as ptdp: nn.Linear GEMMs,
# F.scaled_dot_product_attention (flash, causal), tanh-GeLU, LayerNorm, a tied embedding with the
# vocabulary padded to a multiple of 128 (50304, nanoGPT's trick; ptdp pads the same way), torch.compile
# per block, fused AdamW. Mixed precision the usual PyTorch way, which is numerically what ptdp does:
# fp32 master weights under torch.autocast(bf16) (the GEMMs and attention run in bf16 on bf16 copies of
# the weights; the bf16 weight gradients are accumulated into fp32 .grad over the microbatches) and
# fused AdamW on the fp32 weights. ptdp instead keeps bf16 weights plus separate fp32 main weights and
# fp32 main grads; both read/write about the same bytes per parameter per microbatch.


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, microbatches, clip: float) -> torch.Tensor:
    opt.zero_grad(set_to_none=False)
    total = torch.zeros((), device=microbatches[0][0].device)
    for tokens, labels in microbatches:
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
            logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()) / len(microbatches)
        loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
    opt.step()
    return total


def plain_setup(args, weight_decay: float):
    with torch.device(args.device):
        if args.model == "llama-1b":
            model = PlainLlama(args.padded_vocab, args.seq, args.hidden, args.heads, args.layers, args.groups,
                               args.ffn, base=500000.0)
            model.lm_head.weight = model.wte.weight  # tied, as Llama 3.2 1B (and ptdp's run) is
        else:
            model = PlainGPT(args.padded_vocab, args.seq, args.hidden, args.heads, args.layers)
        for p in model.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
    if not args.no_compile:
        for block in model.blocks:
            block.compile()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-4, fused=args.device == "cuda")
    return model, opt


# ---------------------------------------------------------------------------------------------- ptdp


def ptdp_setup(args):
    from ptdp.config import Config, validate
    from ptdp.train.state import setup

    c = Config()
    m, tr, o = c.model, c.training, c.optimizer
    if args.model == "llama-1b":  # Llama 3.2 1B's shape (GQA, SwiGLU, RoPE, RMSNorm, tied) at s = --seq
        from ptdp.config.presets import MODEL_PRESETS

        for key, value in MODEL_PRESETS["llama3-8b"].items():
            setattr(m, key, value)
        m.num_query_groups, m.ffn_hidden_size = args.groups, args.ffn
        m.untie_embeddings_and_output_weights = False
    m.num_layers, m.hidden_size, m.num_attention_heads = args.layers, args.hidden, args.heads
    m.seq_length, m.vocab_size = args.seq, args.vocab
    m.hidden_dropout = m.attention_dropout = 0.0
    m.compile = not args.no_compile
    m.recompute_granularity, m.checkpoint_in_cpu = args.recompute_granularity, args.checkpoint_in_cpu  # ZeRO-R
    c.precision.bf16 = True
    c.precision.fp8_format, c.precision.fp8_recipe = args.fp8_format, args.fp8_recipe
    o.optimizer_cpu_offload = args.optimizer_cpu_offload
    tr.micro_batch_size, tr.global_batch_size = args.micro_batch_size, args.micro_batch_size * args.microbatches
    tr.train_iters = 10**6
    o.lr, o.lr_warmup_iters, o.lr_decay_style = 1e-4, 0, "constant"
    errors = validate(c, 1)
    if errors:
        raise SystemExit("gpu.py: " + errors[0])
    trainer = setup(c)
    for chunk in trainer.chunks:
        chunk.train()
    return trainer


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peak_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gib() -> float | None:
    """``max_memory_allocated`` since the last reset (None on the CPU: no allocator statistics there)."""
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def timed(step, first: int, iters: int) -> tuple[float, list]:
    """Seconds per iteration over ``iters`` iterations (wall clock between two device syncs), and the
    device scalars the steps returned (read after the timed window)."""
    sync()
    t0 = time.perf_counter()
    outputs = [step(i) for i in range(first, first + iters)]
    sync()
    return (time.perf_counter() - t0) / iters, outputs


def measure_ptdp(args) -> dict:
    from ptdp.train.report import read_records
    from ptdp.train.step import train_step

    reset_peak_memory()
    start = time.perf_counter()
    trainer = ptdp_setup(args)
    setup_s = time.perf_counter() - start
    for it in range(1, args.warmup + 1):  # compilation, allocator warm-up, the first AdamW step
        train_step(trainer, it)
    sync()
    times = []
    losses: list[float] = []
    for r in range(args.repeats):
        seconds, records = timed(lambda i: train_step(trainer, i), args.warmup + 1 + r * args.iters, args.iters)
        times.append(seconds)
        losses += [rec["loss"] for rec in read_records(trainer, records)]
    out = {"iteration_s": statistics.median(times), "repeat_s": times, "setup_s": setup_s,
           "peak_memory_gib": peak_memory_gib(), "final_loss": losses[-1],
           "params": sum(p.numel() for p in trainer.params), "vocab_padded": trainer.chunks[0].output_weight().shape[0],
           "model_flops": model_flops(trainer.config)}
    if args.loss_curve:  # the next --loss-curve iterations' losses, from the same start for every variant
        first = args.warmup + 1 + args.repeats * args.iters
        records = [train_step(trainer, i) for i in range(first, first + args.loss_curve)]
        out["loss_curve"] = [rec["loss"] for rec in read_records(trainer, records)]
    return out


def model_flops(config) -> float:
    """Model FLOPs of one iteration (no recomputation), by the formula the training loop's MFU uses."""
    from ptdp.models import flops

    m, tr = config.model, config.training
    return flops.flops_per_iteration(m.num_layers, m.hidden_size, m.seq_length, m.vocab_size, tr.global_batch_size,
                                     recompute=False, ffn_hidden_size=m.ffn_size, **flops.architecture(m))


def measure_plain(args, batches) -> dict:
    from ptdp.config import OptimizerConfig

    o = OptimizerConfig()  # ptdp's defaults: the same weight decay and clipping
    reset_peak_memory()
    start = time.perf_counter()
    model, opt = plain_setup(args, o.weight_decay)

    def step(i: int) -> torch.Tensor:
        return plain_step(model, opt, batches(i), o.clip_grad)

    setup_s = time.perf_counter() - start
    for it in range(args.warmup):
        step(it)
    sync()
    times, losses = [], []
    for r in range(args.repeats):
        seconds, out = timed(step, args.warmup + r * args.iters, args.iters)
        times.append(seconds)
        losses += torch.stack(out).tolist()
    return {"iteration_s": statistics.median(times), "repeat_s": times, "setup_s": setup_s,
            "peak_memory_gib": peak_memory_gib(), "final_loss": losses[-1]}


def plan_estimate(args) -> dict:
    """``ptdp plan`` for the same case: one GPU, t = p = d = 1, bf16, no recomputation."""
    from ptdp.planner.search import evaluate
    from ptdp.planner.spec import ClusterSpec, GPTSpec, ParallelConfig, TrainingSpec
    from ptdp.runtime import hardware

    found = hardware.accelerator_for_device_name(torch.cuda.get_device_name())
    gpu = found.name if found else "h100-80gb"
    model = GPTSpec(args.layers, args.hidden, args.heads, args.seq, args.vocab)
    cfg = ParallelConfig(1, 1, 1, 1, args.micro_batch_size, "none", False, False)
    est = evaluate(model, cfg, ClusterSpec.of(gpu, 1), TrainingSpec(args.micro_batch_size * args.microbatches, "bf16"))
    return {"gpu": gpu, "iteration_s": est.iteration_time_s, "tflops_per_gpu": est.tflops_per_gpu, "mfu": est.mfu,
            "memory_gib": est.memory.total / 2**30, "fits": est.fits}


MODELS = {  # --model: the shape flags' defaults (each may still be given)
    "gpt-1.3b": {"layers": 24, "hidden": 2048, "heads": 16, "groups": 16, "ffn": 8192, "seq": 2048, "vocab": 50257},
    "llama-1b": {"layers": 16, "hidden": 2048, "heads": 32, "groups": 8, "ffn": 8192, "seq": 2048, "vocab": 128256},
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt-1.3b",
                        help="the shape; llama-1b: Llama 3.2 1B's (GQA, SwiGLU, RoPE, RMSNorm, tied)")
    for name in ("layers", "hidden", "heads", "groups", "ffn", "seq", "vocab"):
        parser.add_argument(f"--{name}", type=int, default=None, help="default: --model's")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="8 fits an 80 GB GPU (about 51 GiB)")
    parser.add_argument("--microbatches", type=int, default=2, help="per iteration (global batch = b x this)")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per repeat")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="eager layers (both loops)")
    parser.add_argument("--skip-plain", action="store_true", help="measure ptdp only")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: toy-sized dry runs only (benchmarks/gpu_suite.py --dry-run)")
    parser.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None, help="ptdp's flag (torchao)")
    parser.add_argument("--fp8-recipe", choices=["tensorwise", "rowwise"], default="tensorwise")
    parser.add_argument("--optimizer-cpu-offload", action="store_true", help="ptdp's flag: Adam on the host")
    parser.add_argument("--recompute-granularity", choices=["full", "selective"], default=None, help="ptdp's flag")
    parser.add_argument("--checkpoint-in-cpu", action="store_true", help="ptdp's flag (ZeRO-R): kept inputs on host")
    parser.add_argument("--loss-curve", type=int, default=0, help="then train this many iterations, record losses")
    return parser


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the shape flags not given from ``--model``'s; the padded vocabulary (a multiple of 128)."""
    for key, value in MODELS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.padded_vocab = -(-args.vocab // 128) * 128
    return args


def measure(args: argparse.Namespace, report: Callable[[dict], None] | None = None) -> dict:
    """ptdp (and, unless ``--skip-plain``, the plain PyTorch loop) on ``args.device``: the JSON object.
    ``report(ptdp)``, if given, hears ptdp's figures before the plain loop runs (a time budget may stop it)."""
    resolve(args)
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 GEMMs (none in the hot path) may use TF32
    from ptdp.runtime import hardware

    tokens = args.micro_batch_size * args.microbatches * args.seq
    peak = hardware.peak_flops_for_current_device() if args.device == "cuda" else None
    ptdp = measure_ptdp(args)
    if report is not None:
        report(ptdp)
    gc.collect()  # the ptdp trainer's memory goes back before the plain model is built
    if args.device == "cuda":
        torch.cuda.empty_cache()
    g = torch.Generator().manual_seed(0)
    data = [[(lambda x: (x[:, :-1].to(args.device), x[:, 1:].to(args.device)))(
        torch.randint(0, args.vocab, (args.micro_batch_size, args.seq + 1), generator=g))
        for _ in range(args.microbatches)] for _ in range(4)]
    plain = None if args.skip_plain else measure_plain(args, lambda i: data[i % len(data)])
    iteration_flops = ptdp["model_flops"]
    for result in (ptdp, plain):
        if result is None:
            continue
        result["tokens_per_s"] = tokens / result["iteration_s"]
        result["tflops_per_gpu"] = iteration_flops / result["iteration_s"] / 1e12  # no recomputation
        result["mfu"] = iteration_flops / result["iteration_s"] / peak if peak else None
    precision = f"fp8-{args.fp8_format}-{args.fp8_recipe}" if args.fp8_format else "bf16"
    return {
        "benchmark": "gpu", "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__, "peak_tflops": peak / 1e12 if peak else None,
        "model": {"name": args.model, "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                  "groups": args.groups, "ffn": args.ffn, "seq": args.seq, "vocab": args.vocab,
                  "micro_batch_size": args.micro_batch_size, "microbatches": args.microbatches,
                  "params": ptdp["params"], "compile": not args.no_compile, "precision": precision,
                  "optimizer_cpu_offload": args.optimizer_cpu_offload,
                  "recompute_granularity": args.recompute_granularity, "checkpoint_in_cpu": args.checkpoint_in_cpu},
        "ptdp": ptdp, "plain_pytorch": plain,
        "mfu": ptdp["mfu"], "tflops_per_gpu": ptdp["tflops_per_gpu"], "tokens_per_s": ptdp["tokens_per_s"],
        "peak_memory_gib": ptdp["peak_memory_gib"],
        "time_over_plain_pytorch": ptdp["iteration_s"] / plain["iteration_s"] if plain else None,
        "goals": {"mfu": 0.55, "time_over_plain_pytorch": 1.02},
        "plan_estimate": plan_estimate(args) if args.model == "gpt-1.3b" and args.device == "cuda" else None,
    }


def main() -> int:
    args = build_parser().parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device here; nothing measured (run it on a GPU machine)")
        return 0
    out = measure(args)
    ptdp, plain = out["ptdp"], out["plain_pytorch"]
    if args.json:
        print(json.dumps(out))
        return 0
    est = out["plan_estimate"]
    print(f"{out['device']}, torch {out['torch']}: GPT {ptdp['params'] / 1e9:.2f}B, b={args.micro_batch_size}, "
          f"m={args.microbatches}, s={args.seq}, bf16{', compiled' if not args.no_compile else ''}")
    for name, r in (("ptdp", ptdp), ("plain PyTorch", plain)):
        if r is not None:
            mfu = f"{r['mfu']:.3f}" if r["mfu"] is not None else "n/a"
            print(f"  {name:14s} {r['iteration_s'] * 1e3:8.1f} ms/iteration  {r['tokens_per_s']:9.0f} tokens/s  "
                  f"{r['tflops_per_gpu']:6.1f} TFLOP/s  MFU {mfu}  peak memory {r['peak_memory_gib']:.1f} GiB  "
                  f"loss {r['final_loss']:.3f}")
    if plain:
        print(f"  time over plain PyTorch: {out['time_over_plain_pytorch']:.3f} (goal <= 1.02)")
    if est:
        print(f"  ptdp plan ({est['gpu']}): {est['iteration_s'] * 1e3:.1f} ms/iteration, "
              f"{est['tflops_per_gpu']:.1f} TFLOP/s, MFU {est['mfu']:.3f}, {est['memory_gib']:.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
