"""What an expert-parallel rank reads of a Hugging Face MoE directory, per expert and fused.

    python benchmarks/hf_expert_reads.py [--experts 32] [--ep 8] [--etp 1] [--json]

Builds a random ``Qwen3MoeForCausalLM`` (h 256, 2 layers, ``--experts`` experts of width 512, fp32) and saves
it twice: as ``save_pretrained`` writes it (per expert: ``mlp.experts.{i}.gate_proj/up_proj/down_proj``)
and in transformers 5's fused layout (``save_original_format=False``: ``mlp.experts.gate_up_proj
[E, 2f, h]``, ``mlp.experts.down_proj [E, h, f]``). For expert rank 1 of ``--ep`` (and tensor rank 1 of
``--etp`` when it is over 1) it reads the boxes ``--load HF_DIR`` asks for (``experts.fc1_weight``/``fc2_weight`` of every
layer) through ``ptdp.checkpointing.hf_reader.HFStorageReader`` from each directory, and prints: the bytes
read against the box (goal: 1.00, no row outside the rank's experts and shard), the reads issued, what the
reads added to the process's resident set at their peak (``VmHWM`` after ``clear_refs``), the seconds, and
the same for reading every expert whole (what one process of ``ptdp import`` reads).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def _rss(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))


def _read(directory: Path, boxes: dict) -> dict:
    """Read ``boxes`` (ptdp name -> per dimension (start, stop)) from ``directory``; what it cost."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    from ptdp.checkpointing.hf_dir import open_hf_dir
    from ptdp.checkpointing.hf_reader import HFStorageReader

    source = open_hf_dir(directory)
    reader = HFStorageReader(source, source.recipes(source.cfg.vocab_size))
    targets, items = {}, []
    for name, box in boxes.items():
        key, zero = f"model.{name}", torch.Size([0] * len(box))
        targets[key] = torch.empty([b - a for a, b in box])
        items.append(ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(key), dest_offsets=zero,
                              storage_index=MetadataIndex(key, zero), storage_offsets=torch.Size([a for a, _ in box]),
                              lengths=targets[key].shape))

    class Planner:
        def resolve_tensor(self, item):
            return targets[item.dest_index.fqn]

        def commit_tensor(self, item, tensor):
            pass

    before = _rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    start = time.perf_counter()
    reader.read_data(LoadPlan(items), Planner()).wait()
    seconds = time.perf_counter() - start
    wanted = sum(t.numel() * 4 for t in targets.values())
    return {"bytes_read": reader.bytes_read, "box_bytes": wanted, "ratio": reader.bytes_read / wanted,
            "reads": len(reader.reads), "added_mib": (_rss("VmHWM") - before) / 2**20, "seconds": seconds}


def main() -> None:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--etp", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    h, f, layers, e = 256, 512, 2, args.experts
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=h, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_experts=e, num_experts_per_tok=2, moe_intermediate_size=f,
        max_position_embeddings=64, tie_word_embeddings=False))
    per, fs = e // args.ep, f // args.etp  # expert rank 1: experts [per, 2·per); tensor rank 1 (if any): rows
    lo = fs if args.etp > 1 else 0
    mine, whole = {}, {}
    for i in range(layers):
        mine[f"layers.{i}.mlp.experts.fc1_weight"] = ((per, 2 * per), (0, 2), (lo, lo + fs), (0, h))
        mine[f"layers.{i}.mlp.experts.fc2_weight"] = ((per, 2 * per), (0, h), (lo, lo + fs))
        whole[f"layers.{i}.mlp.experts.fc1_weight"] = ((0, e), (0, 2), (0, f), (0, h))
        whole[f"layers.{i}.mlp.experts.fc2_weight"] = ((0, e), (0, h), (0, f))
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for layout, original in (("per expert", True), ("fused", False)):
            model.save_pretrained(f"{tmp}/{layout}", max_shard_size="100MB", save_original_format=original)
            for what, boxes in (("rank 1's experts", mine), ("every expert (import)", whole)):
                rows[f"{layout}: {what}"] = _read(Path(f"{tmp}/{layout}"), boxes)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"Qwen3-MoE h {h}, {layers} layers, {e} experts of f {f} (fp32); expert rank 1 of {args.ep}, "
          f"tensor rank 1 of {args.etp}")
    print(f"{'layout: boxes':38} {'box MiB':>8} {'read MiB':>9} {'read/box':>8} {'reads':>6} {'added MiB':>9} "
          f"{'s':>6}")
    for name, r in rows.items():
        print(f"{name:38} {r['box_bytes'] / 2**20:8.1f} {r['bytes_read'] / 2**20:9.1f} {r['ratio']:8.2f} "
              f"{r['reads']:6d} {r['added_mib']:9.1f} {r['seconds']:6.2f}")


if __name__ == "__main__":
    main()
