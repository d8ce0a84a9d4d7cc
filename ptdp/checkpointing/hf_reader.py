"""``--load HF_DIR``: a Hugging Face directory read as if it were a ptdp checkpoint, slice by slice.

``torch.distributed.checkpoint`` loads through a ``StorageReader``: it is handed the checkpoint's metadata
(every saved tensor's global shape and chunks) and, per rank, read items ("elements [a, b) x [c, d) of
tensor X, into this region of mine"). :class:`HFStorageReader` presents the directory as a checkpoint that
holds every ptdp parameter (``model.<logical name>``, fp32, the full shape, one chunk) and answers each read
item by evaluating the family's recipe over just that box (``Recipe.read``, ``ptdp.models.hf_recipe``):
each HF tensor is opened lazily (``safe_open(...).get_slice``) and only the rows and columns that land in
the box are read from disk.

So ``load_checkpoint`` (``state.py``) loads an HF directory exactly as it loads an imported checkpoint:
the same requests from the same placements (TP splits, pipeline stages, vocabulary and expert shards,
ZeRO-3 boxes), the same planner; no rank builds a tensor larger than the part of it it holds.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ptdp.checkpointing.hf_dir import HFDirectory, open_hf_dir
from ptdp.checkpointing.validation import model_shape
from ptdp.config import ModelConfig
from ptdp.models.hf_recipe import Recipe


def hf_metadata(recipes: dict[str, Recipe], shapes: dict[str, tuple[int, ...]]) -> Metadata:
    """DCP metadata of the checkpoint the recipes describe: one fp32 chunk per ptdp parameter."""
    entries = {}
    for name, recipe in recipes.items():
        size = torch.Size(recipe.built_shape(shapes))
        entries[f"model.{name}"] = TensorStorageMetadata(
            properties=TensorProperties(dtype=torch.float32), size=size,
            chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)])
    return Metadata(state_dict_metadata=entries)


class HFStorageReader(StorageReader):
    """DCP's reader over an HF directory (see the module's docstring). ``bytes_read`` counts what this rank
    read from the safetensors files, ``reads`` each (HF tensor, box) it asked for."""

    def __init__(self, source: HFDirectory, recipes: dict[str, Recipe]) -> None:
        super().__init__()
        self.source, self.recipes = source, recipes
        self.metadata = hf_metadata(recipes, source.shapes)
        self.bytes_read = 0
        self.reads: list[tuple[str, tuple[tuple[int, int], ...]]] = []

    def reset(self, checkpoint_id: str | Path | None = None) -> None:
        pass

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        from safetensors import safe_open

        def fetch(name: str, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
            # Opened per slice: safetensors maps the file, and the pages a slice touches count as this
            # process's resident memory while the map lives (a column slice touches the whole tensor).
            with safe_open(str(self.source.files[name]), framework="pt") as handle:
                value = handle.get_slice(name)[tuple(slice(a, b) for a, b in box)]
            self.bytes_read += value.numel() * value.element_size()
            self.reads.append((name, box))
            return value

        for item in plan.items:
            recipe = self.recipes[item.storage_index.fqn.removeprefix("model.")]
            box = tuple((a, a + n) for a, n in zip(item.storage_offsets, item.lengths, strict=True))
            value = recipe.read(box, self.source.shapes, fetch)
            target = planner.resolve_tensor(item).detach()
            target.copy_(value)
            planner.commit_tensor(item, target)
            del value
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | Path) -> bool:
        return False  # chosen explicitly (``open_hf_source``), never by DCP's guessing


def open_hf_source(path: str | Path, model: ModelConfig, vocab_size: int, padded_vocab: int,
                   tp: int) -> tuple[dict, HFStorageReader]:
    """(what ``ptdp.json`` would say, the reader) for ``--load HF_DIR`` in a run whose model has
    ``padded_vocab`` rows: an iteration-0 checkpoint of the model alone, like ``ptdp import``'s, its
    vocabulary padded with zero rows to the run's own padding."""
    source = open_hf_dir(path)
    hf_vocab = source.cfg.vocab_size
    info = {"iteration": 0, "consumed_samples": 0,  # padded as this run pads: any layout loads it
            "model": model_shape(source.cfg, hf_vocab, model.padded_vocab_size(hf_vocab, tp)),
            "layout": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "data_parallel_size": 1,
                       "virtual_pipeline_model_parallel_size": 1, "pipeline_schedule": "1f1b"},
            "contents": ["model"]}
    return info, HFStorageReader(source, source.recipes(padded_vocab if hf_vocab == vocab_size else hf_vocab))
