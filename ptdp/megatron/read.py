"""Reading Megatron-LM checkpoints, in either of the formats ``pretrain_gpt.py`` writes, into full tensors.

A Megatron-LM ``--save`` directory holds ``latest_checkpointed_iteration.txt`` (an iteration number, or
``release``) and one directory per save, ``iter_NNNNNNN/`` (``release/``), in one of two formats:

- ``torch_dist`` (``megatron.core.dist_checkpointing``): ``metadata.json`` naming the backend, ``common.pt``
  (what every rank shares: ``args``, ``iteration``) and a PyTorch distributed checkpoint (``.metadata`` and
  ``__N_M.distcp``) whose tensors are stored by their global shape, layers stacked along a first axis
  (``decoder.layers.self_attention.linear_qkv.weight`` is ``[L, ...]``) and each rank's piece at its global
  offset. It is read here with ``torch.distributed.checkpoint`` in one process, whatever (t, p, e) wrote it;
  megatron-core is not needed.
- ``torch`` (the older format): one ``mp_rank_TT[_PPP]/model_optim_rng.pt`` per tensor/pipeline rank, each
  holding that rank's slice of the model (``model``) with stage-local layer numbers and the run's ``args``.
  The slices are joined along Megatron's split dimensions (column-parallel rows, row-parallel columns, the
  SwiGLU halves each joined on their own).

Both give :class:`MegatronCheckpoint`: full tensors under per-layer Megatron names (``ptdp.megatron.names``).
"""

from __future__ import annotations

import argparse
import json
import re
import warnings
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ptdp.megatron.args import MegatronError
from ptdp.megatron.names import LAYER, canonical
from ptdp.megatron.names import join_slices as _join

if TYPE_CHECKING:
    import torch

TRACKER = "latest_checkpointed_iteration.txt"
COMMON = "common.pt"
METADATA = "metadata.json"
LEGACY_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d+)(?:_(\d+))?(?:_(\d+))?$")

@dataclass
class MegatronCheckpoint:
    """One Megatron-LM save, read whole: full tensors (per-layer names), the run's args, where it stood."""

    directory: Path
    format: str  # "torch_dist" or "torch"
    tensors: dict[str, Any]
    args: dict[str, Any]
    iteration: int
    has_optimizer: bool
    skipped: list[str] = field(default_factory=list)  # non-tensor entries left out (rng, extra states)
    # the distributed optimizer's per-parameter state (``ptdp.megatron.optim``): field -> full tensors under
    # per-layer names, as ``tensors``; and what every rank shared (``common.pt``: param groups, scheduler)
    optimizer: dict[str, dict[str, Any]] = field(default_factory=dict)
    common: dict[str, Any] = field(default_factory=dict)


def iteration_directory(root: str | Path) -> Path:
    """The save ``root``'s tracker names (``iter_NNNNNNN`` or ``release``), or ``root`` itself when it is
    one save's directory."""
    root = Path(root)
    if not root.is_dir():
        raise MegatronError(f"--in {root}: no such directory")
    tracker = root / TRACKER
    if not tracker.is_file():
        if (root / METADATA).is_file() or any(_RANK_DIR.match(p.name) for p in root.iterdir()):
            return root
        raise MegatronError(f"--in {root}: no {TRACKER} (nor one save's files); give Megatron-LM's --save directory")
    text = tracker.read_text().strip()
    if text == "release":
        directory = root / "release"
    elif text.isdigit():
        directory = root / f"iter_{int(text):07d}"
    else:
        raise MegatronError(f"--in {tracker}: holds {text!r}, neither an iteration number nor 'release'")
    if not directory.is_dir():
        raise MegatronError(f"--in {root}: {TRACKER} names {directory.name}, which is missing")
    return directory


def read_checkpoint(root: str | Path, read_optimizer: bool = False) -> MegatronCheckpoint:
    """The newest save under ``root`` (either format), checked whole before anything is written.
    ``read_optimizer``: the distributed optimizer's state too, where the save has it (``torch_dist`` in a
    per-parameter format; anything else is refused by name)."""
    directory = iteration_directory(root)
    if (directory / METADATA).is_file():
        return _read_torch_dist(directory, read_optimizer)
    if any(_RANK_DIR.match(p.name) for p in directory.iterdir()):
        return _read_legacy(directory, read_optimizer)
    raise MegatronError(f"--in {directory}: neither {METADATA} (torch_dist) nor mp_rank_* directories (torch); "
                        "the save is partial")


def _load(path: Path) -> Any:
    import torch

    try:  # a Megatron checkpoint pickles its args (argparse.Namespace, enums): trusted like Megatron's own loader
        return torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise MegatronError(f"--in {path.parent}: {path.name} is missing; the save is partial") from None
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: one line
        raise MegatronError(f"--in {path}: cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                            "the file is corrupt or truncated") from None


def _args_dict(args: Any, where: Path) -> dict[str, Any]:
    if isinstance(args, argparse.Namespace):
        return vars(args)
    if isinstance(args, dict):
        return dict(args)
    raise MegatronError(f"--in {where}: holds no args (Megatron-LM's run arguments); it was not saved by "
                        "pretrain_gpt.py")


# ---------------------------------------------------------------------------------------------- torch_dist

def _read_torch_dist(directory: Path, read_optimizer: bool) -> MegatronCheckpoint:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        backend = json.loads((directory / METADATA).read_text()).get("sharded_backend")
    except json.JSONDecodeError as e:
        raise MegatronError(f"--in {directory / METADATA}: not valid JSON ({e})") from None
    if backend != "torch_dist":
        raise MegatronError(f"--in {directory}: {METADATA} says sharded_backend {backend!r}; ptdp reads torch_dist "
                            "(and the older torch format): convert it with Megatron-LM's --ckpt-convert-format torch_dist")
    common = _load(directory / COMMON)
    args = _args_dict(common.get("args") if isinstance(common, dict) else None, directory / COMMON)
    try:
        metadata = dcp.FileSystemReader(directory).read_metadata()
    except Exception as e:  # noqa: BLE001
        raise MegatronError(f"--in {directory}: its .metadata cannot be read ({type(e).__name__}); the save is "
                            "partial or corrupt") from None
    entries = metadata.state_dict_metadata
    has_optimizer = any(key.startswith("optimizer.") for key in entries)
    from ptdp.megatron.optim import STATE_PREFIX, check_optimizer_format, read_dp_reshardable

    kind = None
    if has_optimizer and read_optimizer:  # a format ptdp cannot map to parameters is refused here, by name
        kind = check_optimizer_format(directory, common, entries)
    wanted = {key: meta for key, meta in entries.items()
              if isinstance(meta, TensorStorageMetadata) and "_extra_state" not in key
              and (not key.startswith(("optimizer.", "rng_state")) or (read_optimizer and key.startswith(STATE_PREFIX)))}
    for key, meta in wanted.items():
        covered = sum(prod(chunk.sizes) for chunk in meta.chunks)
        if covered != prod(meta.size):
            raise MegatronError(f"--in {directory}: {key} has {covered} of its {prod(meta.size)} values saved; "
                                "the save is partial")
    tensors = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype) for key, meta in wanted.items()}
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(tensors, checkpoint_id=directory, no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - a missing or truncated __N_M.distcp
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise MegatronError(f"--in {directory}: its tensors cannot be read ({reason[:200]}); a .distcp file is "
                            "missing or corrupt") from None
    full: dict[str, torch.Tensor] = {}
    optimizer: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        into = full
        if key.startswith(STATE_PREFIX):  # optimizer.state.<field>.<the model's key>
            state_field, key = key.removeprefix(STATE_PREFIX).split(".", 1)
            into = optimizer.setdefault(state_field, {})
        if key.startswith("decoder.layers.") and not LAYER.match(key):
            into.update(_unstack(key.removeprefix("decoder.layers."), value))
        else:
            into[key] = value
    if kind == "dp_reshardable":  # laid out by Megatron's gradient buckets: rebuilt from the model's shapes
        optimizer, groups = read_dp_reshardable(directory, entries, args, {k: tuple(v.shape) for k, v in full.items()})
        common = dict(common, optimizer={"param_state_sharding_type": kind, "optimizer": {"param_groups": groups}})
    skipped = sorted(set(entries) - set(wanted))
    return MegatronCheckpoint(directory, "torch_dist", full, args, int(common.get("iteration", 0)), has_optimizer,
                              skipped, optimizer, common)


def _unstack(suffix: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """A layer-stacked tensor (``[L, ...]``; experts ``[L, E, ...]``) as per-layer (per-expert) tensors."""
    out = {}
    expert = re.match(r"^mlp\.experts\.(?:local_experts|experts)\.(linear_fc[12]\.weight)$", suffix)
    for i in range(value.shape[0]):
        if expert:
            for e in range(value.shape[1]):
                out[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{expert.group(1)}"] = value[i, e]
        else:
            out[f"decoder.layers.{i}.{suffix}"] = value[i]
    return out


# ---------------------------------------------------------------------------------------------- torch (legacy)

def _read_legacy(directory: Path, read_optimizer: bool) -> MegatronCheckpoint:
    ranks = {}
    for path in directory.iterdir():
        match = _RANK_DIR.match(path.name)
        if match:
            if match.group(3) is not None:
                raise MegatronError(f"--in {directory}: {path.name} is an expert-parallel rank; ptdp reads torch-format "
                                    "checkpoints saved with expert_model_parallel_size 1 (save torch_dist instead)")
            ranks[(int(match.group(1)), int(match.group(2) or 0))] = path / LEGACY_FILE
    first = _load(ranks[min(ranks)])
    args = _args_dict(first.get("args"), ranks[min(ranks)])
    t, p = int(args.get("tensor_model_parallel_size", 1)), int(args.get("pipeline_model_parallel_size", 1))
    for name in ("virtual_pipeline_model_parallel_size", "decoder_first_pipeline_num_layers",
                 "decoder_last_pipeline_num_layers", "pipeline_model_parallel_layout"):
        if args.get(name):
            raise MegatronError(f"--in {directory}: the args set {name}={args[name]!r}; ptdp reads torch-format "
                                "checkpoints with even pipeline stages of one model chunk (save torch_dist instead)")
    for tp in range(t):
        for pp in range(p):
            name = f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if p > 1 else "")
            if not (directory / name / LEGACY_FILE).is_file():
                raise MegatronError(f"--in {directory}: {name}/{LEGACY_FILE} is missing (the args say t={t}, p={p}); "
                                    "the save is partial")
    per_stage = int(args["num_layers"]) // p
    distrib = {key: path.parent / "distrib_optim.pt" for key, path in ranks.items()
               if (path.parent / "distrib_optim.pt").exists()}
    has_optimizer = (directory / "distrib_optim.pt").exists() or bool(distrib)
    tensors: dict[str, list] = {}
    states = {}
    for pp in range(p):
        for tp in range(t):
            state = first if (tp, pp) == min(ranks) else _load(ranks[(tp, pp)])
            states[(tp, pp)] = {k: state.get(k) for k in ("optimizer", "opt_param_scheduler")}
            has_optimizer = has_optimizer or bool(state.get("optimizer"))
            if "model" not in state:
                raise MegatronError(f"--in {ranks[(tp, pp)]}: holds no 'model' (a virtual-pipeline or foreign save)")
            for name, value in state["model"].items():
                if "_extra_state" in name or not hasattr(value, "shape"):
                    continue
                match = LAYER.match(name)
                if match:
                    name = f"decoder.layers.{int(match.group(1)) + pp * per_stage}.{match.group(2)}"
                tensors.setdefault(canonical(name), [None] * t)[tp] = value
    full = {name: _join(name, parts, bool(args.get("swiglu"))) for name, parts in tensors.items()}
    optimizer, common = {}, {}
    if has_optimizer and read_optimizer:
        if len(distrib) != len(ranks) or not args.get("use_distributed_optimizer"):
            raise MegatronError(f"--in {directory}: holds the optimizer's state in the torch format without a "
                                "distrib_optim.pt per mp_rank directory (another optimizer, or a partial save); ptdp "
                                "imports the distributed optimizer's, or pass --no-load-optim to start it afresh")
        from ptdp.megatron.optim import read_distrib_optim

        optimizer = read_distrib_optim(directory, args, {k: tuple(v.shape) for k, v in full.items()},
                                       {key: _load(path) for key, path in distrib.items()})
        groups = [g for s in states.values() for g in ((s["optimizer"] or {}).get("optimizer") or {}).get("param_groups", [])]
        common = {"optimizer": {"param_state_sharding_type": "dp_zero", "optimizer": {"param_groups": groups}},
                  "opt_param_scheduler": states[min(states)]["opt_param_scheduler"]}
    return MegatronCheckpoint(directory, "torch", full, args, int(first.get("iteration", 0)), has_optimizer,
                              optimizer=optimizer, common=common)
