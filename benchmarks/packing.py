"""Packed documents: document-masked attention against full causal attention, and end to end.

    python benchmarks/packing.py attention                  # s = 4096, documents of mean 256, 384, 512
    python benchmarks/packing.py attention --device cuda --dtype bf16
    python benchmarks/packing.py train                      # ptdp train's tokens/s with and without the flags

``attention``: forward + backward time of each document kernel (``ptdp.ops.document_attention``: per-document
SDPA and the dense fallback everywhere, varlen flash and FlexAttention on CUDA) beside causal SDPA over the
whole window, on the same q, k, v in the same run, with the fraction of the causal window's query-key pairs
the documents hold (sum l(l+1)/2 over s(s+1)/2: the goal is a time ratio near it). One JSON line per case.
:func:`attention_case` is the function the GPU suite (benchmarks/gpu_suite.py) calls.

``train``: ``ptdp train`` on a corpus of documents of the given mean length, with and without
``--reset-position-ids --reset-attention-mask --eod-mask-loss``, interleaved; tokens/s of each and the ratio.
On a shared or loaded machine only ratios measured in the same run mean anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ptdp.ops.document_attention import BY_NAME, PerDocument, document_attention

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def document_bounds(seq_length: int, mean_document: int, seed: int = 0) -> tuple[int, ...]:
    """cu_seqlens of a window cut into documents of lengths uniform in [1, 2·mean - 1] (the last one cut)."""
    rng = np.random.default_rng(seed)
    bounds = [0]
    while bounds[-1] < seq_length:
        bounds.append(min(seq_length, bounds[-1] + int(rng.integers(1, 2 * mean_document))))
    return tuple(bounds)


def _seconds(fn, device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up (and FlexAttention's compile)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def attention_case(seq_length: int = 4096, mean_document: int = 384, heads: int = 8, head_dim: int = 64,
                   device: str = "cpu", dtype: torch.dtype = torch.float32, kernels: list[str] | None = None,
                   repeats: int = 3, seed: int = 0) -> dict:
    """Forward + backward seconds of causal SDPA over the window and of each document kernel (default: those
    that run on ``device``) on one sample, their ratios, each kernel's largest difference from per-document
    SDPA in fp32, and the fraction of the window's causal pairs inside the documents."""
    dev = torch.device(device)
    if kernels is None:
        kernels = ["per-document", "dense"] + (["varlen", "flex"] if dev.type == "cuda" else [])
    bounds = document_bounds(seq_length, mean_document, seed)
    g = torch.Generator().manual_seed(seed)
    q, k, v, grad = (torch.randn(1, heads, seq_length, head_dim, generator=g).to(dev, dtype) for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    full = _seconds(lambda: F.scaled_dot_product_attention(*leaves, is_causal=True).backward(grad), dev, repeats)
    pairs = sum((e - a) * (e - a + 1) // 2 for a, e in zip(bounds[:-1], bounds[1:]))
    with torch.no_grad():
        reference = PerDocument()(q.float(), k.float(), v.float(), [bounds], 0.0, {})
    result = {"seq_length": seq_length, "mean_document": mean_document, "documents": len(bounds) - 1,
              "heads": heads, "head_dim": head_dim, "device": str(dev), "dtype": str(dtype).split(".")[-1],
              "computed_fraction": pairs / (seq_length * (seq_length + 1) // 2), "full_causal_s": full}
    for name in kernels:
        try:
            with torch.no_grad():
                diff = (document_attention(q, k, v, bounds, name).float() - reference).abs().max().item()
            seconds = _seconds(lambda n=name: document_attention(*leaves, bounds, n).backward(grad), dev, repeats)
            result[name] = {"seconds": seconds, "over_full_causal": seconds / full, "max_abs_diff": diff}
        except Exception as e:  # a kernel this machine cannot run: say why, measure the others
            result[name] = {"error": str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__}
    return result


def _corpus(prefix: Path, mean_document: int, tokens: int) -> None:
    from ptdp.data import ByteTokenizer, IndexedDatasetWriter

    rng = np.random.default_rng(0)
    writer = IndexedDatasetWriter(str(prefix), ByteTokenizer.vocab_size)
    written = 0
    while written < tokens:
        n = int(rng.integers(1, 2 * mean_document))
        writer.add_document([*rng.integers(32, 127, n - 1), ByteTokenizer.eod_id])
        written += n
    writer.finalize()


def _tokens_per_s(args, prefix: Path, flags: list[str], out: Path) -> float:
    metrics = out / f"m-{len(list(out.iterdir()))}.jsonl"
    command = [sys.executable, "-m", "ptdp", "train", "--num-layers", str(args.layers), "--hidden-size",
               str(args.hidden), "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq),
               "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", str(args.iters),
               "--lr-warmup-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
               "--data-path", str(prefix), "--tokenizer-type", "ByteTokenizer", "--split", "1,0,0",
               "--metrics-file", str(metrics), *flags]
    subprocess.run(command, check=True, capture_output=True)
    records = [json.loads(line) for line in metrics.read_text().splitlines()][1:]  # the first warms up
    return statistics.median(r["tokens_per_s"] for r in records)


def train(args) -> dict:
    flags = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prefix = root / "docs"
        _corpus(prefix, args.mean_document, args.seq * (args.iters + 2) * 2)
        (root / "runs").mkdir()
        plain, packed = [], []
        for _ in range(args.rounds):  # interleaved: both see the same load
            plain.append(_tokens_per_s(args, prefix, [], root / "runs"))
            packed.append(_tokens_per_s(args, prefix, flags, root / "runs"))
    p, q = statistics.median(plain), statistics.median(packed)
    return {"seq_length": args.seq, "mean_document": args.mean_document, "layers": args.layers,
            "hidden": args.hidden, "heads": args.heads, "plain_tokens_per_s": p, "documents_tokens_per_s": q,
            "documents_over_plain": q / p}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    a = sub.add_parser("attention")
    a.add_argument("--seq", type=int, default=4096)
    a.add_argument("--mean-documents", type=int, nargs="+", default=[256, 384, 512])
    a.add_argument("--heads", type=int, default=8)
    a.add_argument("--head-dim", type=int, default=64)
    a.add_argument("--device", default="cpu")
    a.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    a.add_argument("--kernels", nargs="+", choices=sorted(BY_NAME))
    a.add_argument("--repeats", type=int, default=3)
    t = sub.add_parser("train")
    t.add_argument("--seq", type=int, default=4096)
    t.add_argument("--mean-document", type=int, default=384)
    t.add_argument("--layers", type=int, default=2)
    t.add_argument("--hidden", type=int, default=128)
    t.add_argument("--heads", type=int, default=4)
    t.add_argument("--iters", type=int, default=4)
    t.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.what == "train":
        print(json.dumps(train(args)), flush=True)
        return
    for mean in args.mean_documents:
        print(json.dumps(attention_case(args.seq, mean, args.heads, args.head_dim, args.device, DTYPES[args.dtype],
                                        args.kernels, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
