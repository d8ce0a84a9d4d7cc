"""``ptdp export --format hf``, streamed: one parameter at a time from the sharded checkpoint into HF's
sharded safetensors layout, never the whole model in one process.

For a family that declares per-tensor recipes (``ModelFamily.hf_recipes``, ``ptdp.models.hf_recipe``),
each full ptdp parameter is read alone (``FullModelReader.tensor``: DCP reads just that key), cut into its
HF tensors by running its recipe backwards (``scatter``: the fused QKV into q/k/v, fc1 into gate/up, the
vocabulary padding dropped), and appended to the current output shard (an HF tensor that several
parameters fill, such as Qwen3-Next's ``q_proj`` of queries and output gates, once the last of them is
read). A shard is written once it would
pass ``--max-shard-size`` (HF's ``save_pretrained`` default: 5GB), named as HF names them
(``model-00001-of-00003.safetensors``), with ``model.safetensors.index.json``; a model that fits in one
shard is written as ``model.safetensors``, as ``save_pretrained`` does. Peak memory: one parameter (and
its HF pieces) plus the shard being filled.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from ptdp.config import ConfigError

if TYPE_CHECKING:
    import torch

    from ptdp.checkpointing.full_model import FullModelReader
    from ptdp.models.family import ModelFamily

HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """Bytes of a size as HF writes it: ``5GB`` (10^9), ``500MiB`` (2^20), ``1000000``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).upper() not in _UNITS or float(match.group(1)) <= 0:
        raise ConfigError(f"--max-shard-size {text!r}: give a positive size such as 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


class ShardWriter:
    """HF's sharded safetensors layout, written shard by shard as tensors arrive."""

    def __init__(self, out: Path, max_bytes: int) -> None:
        self.out, self.max_bytes = out, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.written: list[tuple[Path, list[str]]] = []  # (temporary file, its tensor names)
        self.total = 0
        self.peak_pending_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor
        self.pending_bytes += size
        self.total += size
        self.peak_pending_bytes = max(self.peak_pending_bytes, self.pending_bytes)

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        path = self.out / f".shard-{len(self.written):05d}.safetensors.tmp"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.written.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Write the last shard, name the shards, write the index (several shards); the file names."""
        self.flush()
        for stale in [self.out / HF_WEIGHTS, self.out / HF_INDEX, *self.out.glob("model-*-of-*.safetensors")]:
            stale.unlink(missing_ok=True)  # an earlier export into the same directory
        if len(self.written) == 1:
            self.written[0][0].replace(self.out / HF_WEIGHTS)
            return [HF_WEIGHTS]
        n, weight_map, names = len(self.written), {}, []
        for k, (path, tensors) in enumerate(self.written, start=1):
            name = f"model-{k:05d}-of-{n:05d}.safetensors"
            path.replace(self.out / name)
            weight_map.update(dict.fromkeys(tensors, name))
            names.append(name)
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / HF_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return [*names, HF_INDEX]


def write_streamed(model: FullModelReader, family: ModelFamily, cfg, moe, out: Path, max_bytes: int) -> list[str]:
    """Write the checkpoint ``model`` reads as HF safetensors shards under ``out``, one parameter at a time;
    the files written."""
    import torch

    from ptdp.models.hf_tensors import assemble

    padded = model.shape("embedding.word_embeddings.weight")[0]
    recipes = family.hf_recipes(cfg, moe, padded)
    if recipes.keys() != model.sources.keys():
        odd = sorted(recipes.keys() ^ model.sources.keys())
        raise ConfigError(f"--load: the checkpoint's parameters are not the {family.name} family's ({odd[:3]})")
    writer = ShardWriter(out, max_bytes)
    left = Counter(hf_name for recipe in recipes.values() for hf_name in {t.name for t in recipe.takes()})
    pieces: dict[str, list] = {}
    for name, recipe in recipes.items():
        for hf_name, rows, value in recipe.scatter(model.tensor(name)):
            pieces.setdefault(hf_name, []).append((rows, value))
        left.subtract({t.name for t in recipe.takes()})
        for hf_name in [n for n in pieces if left[n] <= 0]:  # complete (a copy's count is 0 from the start)
            value = assemble(pieces.pop(hf_name), hf_name).detach().to(torch.float32)
            writer.add(hf_name, value.clone(memory_format=torch.contiguous_format))  # own, packed storage
    return writer.close()
