"""A Hugging Face model directory as a ``--load`` source: its files and their checks (no torch here).

``ptdp train --load HF_DIR`` takes a directory written by ``save_pretrained`` (config.json and either
``model.safetensors`` or ``model.safetensors.index.json`` with the shards it names). The model family
(``ptdp.models.families``, by config.json's ``model_type``) gives the model flags and, per ptdp parameter,
a recipe over HF tensor names (``ptdp.models.hf_recipe``). Everything that can be wrong with the directory
is found here, from config.json and the safetensors headers alone (a few KiB each, no tensor data), in the
launcher before any worker starts: one line naming the file, exit 2. ``hf_reader`` then reads the data.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from ptdp.checkpointing.storage import INFO, LATEST, CheckpointError
from ptdp.config import ConfigError, ModelConfig, MoEConfig

HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class HFDirectory:
    """What the headers say: per HF tensor its file, shape and dtype; the family's model flags."""

    path: Path
    family_name: str
    cfg: ModelConfig
    moe: MoEConfig
    files: dict[str, Path]  # tensor name -> the file holding it
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]

    def recipes(self, padded_vocab: int) -> dict:
        """Per ptdp parameter, its recipe (the vocabulary padded to ``padded_vocab`` rows)."""
        family = next(f for f in _families() if f.name == self.family_name)
        return family.hf_recipes(self.cfg, self.moe, padded_vocab)


def _families():
    from ptdp.models.families import FAMILIES

    return FAMILIES


def is_hf_dir(path: str | Path) -> bool:
    """Whether ``--load PATH`` is a Hugging Face model directory rather than a ptdp checkpoint."""
    path = Path(path)
    return (not (path / LATEST).exists() and not (path / INFO).exists()
            and ((path / HF_WEIGHTS).exists() or (path / HF_INDEX).exists()))


def read_header(file: Path) -> dict:
    """The safetensors header of ``file`` (name -> dtype, shape, data_offsets), checked against its size."""
    try:
        with file.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file} is truncated (no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            size = file.stat().st_size
            if 8 + n > size:
                raise CheckpointError(f"{file} is truncated (its header says {n} bytes, the file has {size})")
            header = json.loads(fh.read(n))
    except FileNotFoundError:
        raise CheckpointError(f"{file.name} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{file} is not a safetensors file (its header is not JSON)") from None
    header.pop("__metadata__", None)
    end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"{file} is truncated ({size} bytes; its tensors need {8 + n + end})")
    return header


def open_hf_dir(path: str | Path) -> HFDirectory:
    """Read config.json, the index and every shard's header; :class:`CheckpointError` (one line naming the
    file) for anything missing, unreadable or unsupported."""
    from ptdp.models.families import family_for_hf

    path = Path(path)
    try:
        hf_config = json.loads((path / HF_CONFIG).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} has safetensors weights but no {HF_CONFIG}; give the whole directory "
                              "save_pretrained wrote") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path / HF_CONFIG} is not valid JSON ({e})") from None
    family = family_for_hf(hf_config.get("model_type"))
    if family is None or family.hf_model is None or family.hf_recipes is None:
        direct = ", ".join(repr(f.hf_model_type) for f in _families() if f.hf_recipes is not None)
        raise CheckpointError(f"{path / HF_CONFIG} has model_type {hf_config.get('model_type')!r}; --load reads "
                              f"model types {direct} directly; convert others with `ptdp import --format hf`")
    try:
        cfg, moe = family.hf_model(hf_config)
    except ConfigError as e:
        raise CheckpointError(f"{path / HF_CONFIG}: {str(e).removeprefix('--in: ')}") from None
    except KeyError as e:
        raise CheckpointError(f"{path / HF_CONFIG} lacks {e}") from None
    if (path / HF_INDEX).exists():
        try:
            weight_map = json.loads((path / HF_INDEX).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{path / HF_INDEX} is not a safetensors index ({e})") from None
    else:
        weight_map = None
    files: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for name in sorted(set(weight_map.values()) if weight_map is not None else {HF_WEIGHTS}):
        file = path / name
        try:
            header = read_header(file)
        except CheckpointError as e:
            named = f" (named by {HF_INDEX})" if weight_map is not None else ""
            raise CheckpointError(f"{path}: {e}{named}") from None
        for tensor, entry in header.items():
            files[tensor], shapes[tensor], dtypes[tensor] = file, tuple(entry["shape"]), entry["dtype"]
    for tensor, name in (weight_map or {}).items():
        if files.get(tensor) != path / name:
            raise CheckpointError(f"{path / name} has no tensor {tensor} ({HF_INDEX} names it there)")
    if family.hf_refine is not None:
        try:
            cfg = family.hf_refine(cfg, moe, hf_config, shapes)
        except ConfigError as e:
            raise CheckpointError(f"{path}: {str(e).removeprefix('--in: ')}") from None
    return HFDirectory(path, family.name, cfg, moe, files, shapes, dtypes)


def check_recipes(source: HFDirectory, padded_vocab: int) -> None:
    """Every tensor the recipes take exists, with the rows they take: else one line naming it."""
    from ptdp.models.hf_recipe import RecipeError

    for name, recipe in source.recipes(padded_vocab).items():
        try:
            recipe.built_shape(source.shapes)
        except RecipeError as e:
            raise CheckpointError(f"{source.path}: {e} (needed for {name}); is it a {source.family_name} model?") \
                from None


def moe_mismatch(source: HFDirectory, moe: MoEConfig) -> str | None:
    """One line when the run's expert flags are not the directory's: the experts, the router and the shared
    expert (without its flags a run would build no shared expert and silently leave the directory's unread)."""
    keys = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_pre_softmax",
            "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_router_score_function",
            "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
            "moe_router_topk_scaling_factor")
    diffs = [f"--{k.replace('_', '-')} {getattr(source.moe, k)} there, {getattr(moe, k)} here"
             for k in keys if getattr(source.moe, k) != getattr(moe, k)]
    return "the directory holds another model: " + "; ".join(diffs) if diffs else None
