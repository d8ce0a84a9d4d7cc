"""Data-pipeline benchmark: preprocessing throughput and data-loader time per iteration.

    python benchmarks/data.py --json            # one JSON line on stdout
    python benchmarks/data.py --mb 30 --workers 2

Preprocessing: a JSONL of ``--mb`` MB is generated from this Python's stdlib sources (one record per
file, repeated), then ``ptdp preprocess`` runs with 1 worker (baseline) and ``--workers`` workers, byte
tokenizer; BPE (vocab 8192) is trained on 5 MB, then encodes the whole file with 1 and ``--workers``. Data loader: ``get_microbatch`` for
every microbatch of a small GPT global batch on the default corpus; compare with the trainer's step time.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import sys
import tempfile
import time

from ptdp.data import build_datasets, get_microbatch
from ptdp.data.default_corpus import stdlib_sources
from ptdp.data.preprocess import main as preprocess_main


def make_jsonl(path: str, megabytes: float) -> int:
    root, files = stdlib_sources()
    records = []
    for rel in files:
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            records.append(json.dumps({"text": f.read()}) + "\n")
    target, written = int(megabytes * 2**20), 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            for rec in records:
                f.write(rec)
                written += len(rec.encode())
                if written >= target:
                    break
    return written


def time_preprocess(src: str, prefix: str, *extra: str) -> dict:
    out = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out):
        code = preprocess_main(["--input", src, "--output-prefix", prefix, *extra])
    seconds = time.perf_counter() - start
    if code:
        raise SystemExit(f"preprocess failed with exit code {code}")
    summary = json.loads(out.getvalue().strip().splitlines()[-1])
    return {
        "seconds": round(seconds, 3),
        "MB_per_s": round(summary["input_bytes"] / 2**20 / seconds, 2),
        "tokens": summary["tokens"],
    }


def time_loader(seq_length: int, global_batch: int, micro_batch: int, iterations: int) -> dict:
    train = build_datasets(None, "969,30,1", seq_length, seed=1234).train
    num_micro = global_batch // micro_batch
    get_microbatch(train, 0, global_batch, 0, 1, micro_batch, 0)  # warm the page cache and epoch permutation
    start = time.perf_counter()
    for k in range(iterations):
        for j in range(num_micro):
            get_microbatch(train, k, global_batch, 0, 1, micro_batch, j)
    per_iter = (time.perf_counter() - start) / iterations
    return {
        "seq_length": seq_length,
        "global_batch": global_batch,
        "micro_batch": micro_batch,
        "ms_per_iteration": round(per_iter * 1e3, 3),
        "us_per_sample": round(per_iter / global_batch * 1e6, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=float, default=30.0, help="size of the generated JSONL in MB")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--skip-bpe", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON line only")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "corpus.jsonl")
        size = make_jsonl(src, args.mb)
        byte1 = time_preprocess(src, os.path.join(tmp, "b1"), "--workers", "1")
        byten = time_preprocess(src, os.path.join(tmp, "bn"), "--workers", str(args.workers))
        bpe = {}
        if not args.skip_bpe:
            # Train once on a subset (training is the Rust library's, multi-threaded), then time encoding
            # the full file with that tokenizer at 1 and N workers: that is the part --workers speeds up.
            small = os.path.join(tmp, "small.jsonl")
            make_jsonl(small, min(args.mb, 5.0))
            trained = time_preprocess(
                small, os.path.join(tmp, "train"), "--tokenizer", "bpe", "--vocab-size", "8192"
            )
            bpe["train_5MB_seconds"] = trained["seconds"]
            tok_file = os.path.join(tmp, "train.tokenizer.json")
            for workers in (1, args.workers):
                bpe[f"encode_workers{workers}"] = time_preprocess(
                    src,
                    os.path.join(tmp, f"bpe{workers}"),
                    "--tokenizer",
                    "bpe",
                    "--tokenizer-file",
                    tok_file,
                    "--workers",
                    str(workers),
                )
            bpe["encode_speedup"] = round(
                bpe["encode_workers1"]["seconds"] / bpe[f"encode_workers{args.workers}"]["seconds"], 2
            )
    loader = time_loader(seq_length=256, global_batch=32, micro_batch=4, iterations=200)
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
        f"Python {platform.python_version()}",
        "jsonl_MB": round(size / 2**20, 1),
        "preprocess_byte_workers1": byte1,
        f"preprocess_byte_workers{args.workers}": byten,
        "preprocess_speedup": round(byte1["seconds"] / byten["seconds"], 2),
        "preprocess_bpe8192": bpe,
        "loader": loader,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(main())
