"""Peak memory of ``--load HF_DIR`` per rank, against the rank's shard and against the import path.

    python benchmarks/hf_load_memory.py [--tp 2] [--json]

Builds a random Hugging Face Llama of about 124M parameters (h 768, 12 layers, GQA 12/4 heads, ffn 2048,
vocabulary 32000, untied; fp32, saved in 100 MB shards), then measures:

- the import path's one process: ``ptdp import --format hf`` (what it adds to the process's resident set);
- ``t`` CPU ranks (gloo) that build the run (``ptdp.train.state.setup``) and load, first the HF directory
  directly, then the imported checkpoint: per load, each rank resets its peak (``echo 5 >
  /proc/self/clear_refs``) and reports ``VmHWM - VmRSS before``, the memory the load added. The shard is the
  rank's parameters (fp32 bytes); the ratio is ``(shard + added) / shard``: the peak over the shard plus
  what the process held besides (torch, the gradient buffers). Goal: <= 1.3.
- ``ptdp export`` of the imported checkpoint, streamed (one parameter at a time, 100 MB shards), and the
  whole-model conversion it replaced: what each adds to its process's resident set.

Freed tensors go back to the system (``MALLOC_MMAP_THRESHOLD_`` at 128 KiB), so the peaks are real
high-water marks, not malloc's reuse of old pages.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ptdp.runtime.exit import exit_now

HF = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
          num_key_value_heads=4, max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=None,
          eos_token_id=None, pad_token_id=None)
RUN = ["--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
       "--hidden-dropout", "0", "--attention-dropout", "0"]


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _measure(fn) -> tuple[int, int, float]:
    """(VmRSS before, VmHWM - VmRSS before, seconds) of ``fn``, between barriers."""
    dist.barrier()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    start = time.perf_counter()
    fn()
    dist.barrier()
    return before, _status("VmHWM") - before, time.perf_counter() - start


def _worker(rank: int, world: int, store: str, flags: list[str], hf_dir: str, ckpt: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from ptdp.checkpointing import load_checkpoint
    from ptdp.cli.main import build_parser
    from ptdp.config import config_from_args, derive
    from ptdp.train.state import setup

    config = derive(config_from_args(build_parser().parse_args(
        ["train", *flags, "--tensor-model-parallel-size", str(world)])))
    trainer = setup(config)
    shard = sum(p.numel() * p.element_size() for p in trainer.params)
    row = {"rank": rank, "shard_bytes": shard}
    for name, path in (("hf_dir", hf_dir), ("imported", ckpt)):
        before, added, seconds = _measure(lambda path=path: load_checkpoint(trainer, path))
        row[name] = {"rss_before": before, "added": added, "seconds": round(seconds, 2),
                     "ratio": round((shard + added) / shard, 3)}
    rows: list = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()
    exit_now(0)


_CHILD = """
import json, sys, time
import torch, safetensors.torch, torch.distributed.checkpoint, transformers
from ptdp.hf.convert import export_hf, import_hf_model
import ptdp.checkpointing.full_model, ptdp.models, ptdp.models.hf_recipe
transformers.LlamaConfig, transformers.AutoConfig  # the libraries load before the measurement, as the ranks' do

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

before = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")
start = time.perf_counter()
if sys.argv[1] == "import":
    import_hf_model(sys.argv[2], sys.argv[3])
elif sys.argv[1] == "export":
    export_hf(sys.argv[2], sys.argv[3], max_shard_size="100MB")
else:  # the export before streaming: the whole model read, converted, then written
    from safetensors.torch import save_file
    from ptdp.checkpointing import read_full_model_state
    from ptdp.hf.convert import model_config_from_dict, moe_config_from_dict
    from ptdp.models.families import family_of
    tensors, config = read_full_model_state(sys.argv[2])
    cfg, moe = model_config_from_dict(config), moe_config_from_dict(config)
    save_file(family_of(cfg, moe).write(tensors, cfg, moe), sys.argv[3] + ".safetensors")
print(json.dumps({"rss_before": before, "added": status("VmHWM") - before, "seconds": time.perf_counter() - start}))
"""


def _in_child(*args: str) -> dict:
    """What ``ptdp import`` / ``export`` (their functions, in a fresh process) add to its resident set."""
    out = subprocess.run([sys.executable, "-c", _CHILD, *args], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import transformers

    from ptdp.hf.convert import train_flags
    from ptdp.models.families import family_for_hf

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, ckpt = Path(tmp) / "hf", Path(tmp) / "ckpt"
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF))
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(str(hf_dir), max_shard_size="100MB")
        del model
        cfg, moe = family_for_hf("llama").hf_model(json.loads((hf_dir / "config.json").read_text()))
        flags = [*train_flags(cfg, moe).split(), *RUN, "--vocab-size", str(HF["vocab_size"])]
        imported = _in_child("import", str(hf_dir), str(ckpt))
        exported = _in_child("export", str(ckpt), str(Path(tmp) / "out"))
        whole = _in_child("export_whole", str(ckpt), str(Path(tmp) / "whole"))
        out = str(Path(tmp) / "rows.json")
        mp.start_processes(_worker, args=(args.tp, str(Path(tmp) / "store"), flags, str(hf_dir), str(ckpt), out),
                           nprocs=args.tp, start_method="spawn")
        rows = json.loads(Path(out).read_text())
    model_bytes = params * 4
    result = {"parameters": params, "model_bytes": model_bytes, "tp": args.tp, "import": imported,
              "export": exported, "export_whole_model": whole, "per_rank": rows}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    mb = 2**20
    print(f"HF Llama {params / 1e6:.1f}M parameters, fp32 ({model_bytes / mb:.0f} MiB), t={args.tp}, CPU ranks")
    for name, m in (("ptdp import (one process)", imported), ("ptdp export, streamed, 100MB shards", exported),
                    ("export of the whole model at once (before)", whole)):
        print(f"{name}: before {m['rss_before'] / mb:.0f} MiB, +{m['added'] / mb:.0f} MiB = "
              f"{m['added'] / model_bytes:.2f}x the model ({m['seconds']:.1f} s)")
    for r in rows:
        print(f"  rank {r['rank']}: shard {r['shard_bytes'] / mb:.0f} MiB; load +added over what the rank held")
        for name in ("hf_dir", "imported"):
            m = r[name]
            print(f"    --load {name:8s}: before {m['rss_before'] / mb:5.0f} MiB, +{m['added'] / mb:4.0f} MiB "
                  f"-> (shard + added) / shard = {m['ratio']:.2f} ({m['seconds']} s)")


if __name__ == "__main__":
    main()
