"""``ptdp preprocess`` against Megatron-LM's ``tools/preprocess_data.py`` logic, and a large Parquet file in
bounded memory.

    python benchmarks/preprocess.py --json                       # both parts, one JSON line on stdout
    python benchmarks/preprocess.py --jsonl-mb 20 --workers 2 --parquet-mb 1024

1. Throughput: a JSONL of ``--jsonl-mb`` MB (this Python's stdlib sources as documents), one Hugging Face
   BPE tokenizer directory (trained here, vocab 8192), the same ``--workers``:
   - ptdp: ``ptdp preprocess --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR``;
   - Megatron (baseline): ``preprocess_data.py``'s structure transcribed: ``Pool(workers).imap(encoder.encode,
     fin, 32)``, one ``json.loads`` and one ``tokenizer.encode`` per line in the workers, the ids appended
     as one document each to a ``.bin`` with an ``MMIDIDX`` index (Megatron's builder, minus torch tensors).
   Reported as tokens/s and the ratio ptdp / Megatron, both outputs checked token-equal.
2. Memory: a Parquet file of ``--parquet-mb`` MB (text column, written in row groups), ``ptdp preprocess``
   (byte tokenizer) with stderr to a file: peak resident memory of the whole process tree (sampled from
   /proc every 50 ms) and the progress lines it printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data import make_jsonl  # noqa: E402  (benchmarks/data.py)

MEGATRON = r'''
import json, sys, multiprocessing, numpy as np, struct, time
start = time.perf_counter()
from tokenizers import Tokenizer
src, tok_file, out, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
class Encoder:  # megatron/tools/preprocess_data.py: Encoder.initializer / Encoder.encode
    def initializer(self):
        Encoder.tokenizer = Tokenizer.from_file(tok_file)
        Encoder.eod = Encoder.tokenizer.token_to_id("<|endoftext|>")
    def encode(self, json_line):
        data = json.loads(json_line)
        ids = Encoder.tokenizer.encode(data["text"], add_special_tokens=False).ids
        ids.append(Encoder.eod)  # --append-eod
        return ids, len(json_line)
encoder = Encoder()
pool = multiprocessing.Pool(workers, initializer=encoder.initializer)
lengths = []
with open(src, encoding="utf-8") as fin, open(out + ".bin", "wb") as fbin:
    for ids, _ in pool.imap(encoder.encode, fin, 32):
        fbin.write(np.array(ids, dtype=np.uint16).tobytes())  # IndexedDatasetBuilder.add_item
        lengths.append(len(ids))
pool.close()
n = len(lengths)
with open(out + ".idx", "wb") as f:
    f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8) + struct.pack("<Q", n) + struct.pack("<Q", n + 1))
    lens = np.asarray(lengths, np.int32)
    f.write(lens.tobytes())
    f.write((np.concatenate([[0], np.cumsum(lens[:-1], dtype=np.int64)]) * 2).astype(np.int64).tobytes())
    f.write(np.arange(n + 1, dtype=np.int64).tobytes())
print(json.dumps({"seconds": time.perf_counter() - start}))
'''


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total


def run_measured(cmd: list[str], stderr_path: str) -> tuple[float, int, str]:
    """(seconds, peak tree RSS bytes, stdout)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(stderr_path, "w") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, tree_rss(proc.pid))
            time.sleep(0.05)
        seconds = time.perf_counter() - start
        out = proc.stdout.read()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{open(stderr_path).read()[-2000:]}")
    return seconds, peak, out


def throughput(tmp: str, mb: float, workers: int) -> dict:
    from ptdp.data import BPETokenizer, IndexedDataset

    src = os.path.join(tmp, "in.jsonl")
    make_jsonl(src, mb)
    tok_dir = os.path.join(tmp, "tok")
    os.makedirs(tok_dir)
    texts = (json.loads(line)["text"] for _, line in zip(range(300), open(src)))
    BPETokenizer.train(texts, 8192).save(os.path.join(tok_dir, "tokenizer.json"))
    ptdp_cmd = [sys.executable, "-m", "ptdp", "preprocess", "--input", src, "--output-prefix", os.path.join(tmp, "p"),
                "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok_dir, "--workers", str(workers)]
    meg_cmd = [sys.executable, "-c", MEGATRON, src, os.path.join(tok_dir, "tokenizer.json"), os.path.join(tmp, "m"),
               str(workers)]
    wall_meg, rss_meg, out_meg = run_measured(meg_cmd, os.path.join(tmp, "m.err"))
    wall_ptdp, rss_ptdp, out = run_measured(ptdp_cmd, os.path.join(tmp, "p.err"))
    tokens = json.loads(out.splitlines()[-1])["tokens"]
    # Work time, from after the imports (ptdp's CLI imports torch; Megatron's script would too): the summary's
    # "seconds" and the same span in the transcription.
    t_ptdp, t_meg = json.loads(out.splitlines()[-1])["seconds"], json.loads(out_meg.splitlines()[-1])["seconds"]
    a, b = IndexedDataset(os.path.join(tmp, "p")), IndexedDataset(os.path.join(tmp, "m"))
    assert a.num_tokens == b.num_tokens == tokens and (a.tokens[:] == b.tokens[:]).all(), "outputs differ"
    return {"jsonl_mb": mb, "workers": workers, "tokens": tokens,
            "ptdp_tokens_per_s": round(tokens / t_ptdp), "megatron_tokens_per_s": round(tokens / t_meg),
            "ptdp_over_megatron": round(t_meg / t_ptdp, 2), "wall_s_ptdp": round(wall_ptdp, 1),
            "wall_s_megatron": round(wall_meg, 1), "ptdp_peak_rss_mb": rss_ptdp >> 20,
            "megatron_peak_rss_mb": rss_meg >> 20}


def parquet_memory(tmp: str, mb: float, workers: int) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from data import stdlib_sources

    root, files = stdlib_sources()
    docs = [open(os.path.join(root, r), encoding="utf-8", errors="replace").read() for r in files]
    path, written = os.path.join(tmp, "big.parquet"), 0
    schema = pa.schema([("text", pa.string())])
    with pq.ParquetWriter(path, schema) as writer:  # row groups of the stdlib, repeated: never all in memory
        while written < mb * 2**20:
            writer.write_table(pa.table({"text": docs}, schema=schema))
            written = os.path.getsize(path)  # row groups reach the file as they are written
    size = os.path.getsize(path)
    cmd = [sys.executable, "-m", "ptdp", "preprocess", "--input", path, "--output-prefix", os.path.join(tmp, "big"),
           "--workers", str(workers), "--progress-interval", "2"]
    seconds, peak, out = run_measured(cmd, os.path.join(tmp, "big.err"))
    lines = open(os.path.join(tmp, "big.err")).read().splitlines()
    summary = json.loads(out.splitlines()[-1])
    return {"parquet_mb": size >> 20, "workers": workers, "seconds": round(seconds, 1),
            "tokens_per_s": round(summary["tokens"] / seconds), "peak_rss_mb": peak >> 20,
            "progress_lines": len(lines), "last_progress_line": lines[-1] if lines else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jsonl-mb", type=float, default=20)
    parser.add_argument("--parquet-mb", type=float, default=1024)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--skip-parquet", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = {"cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_throughput:
            result["throughput"] = throughput(tmp, args.jsonl_mb, args.workers)
        if not args.skip_parquet:
            result["parquet"] = parquet_memory(tmp, args.parquet_mb, args.workers)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
