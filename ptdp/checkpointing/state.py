"""What a checkpoint holds and how it goes through ``torch.distributed.checkpoint`` (DCP).

The saved state is the *logical* model: one entry per full parameter, keyed by its layout-independent
name (``model.layers.3.mlp.fc1.weight``), whatever t, p, d and v were. Each rank hands DCP its local
piece as a ``DTensor`` built from the parameter's placement (``ptdp.parallel.placement.to_dtensor``: one
``Shard(dim)`` per split, on the mesh dimensions the splits name), a plain tensor for replicated ones;
DCP records the global shape and each chunk's offset, keeps one copy of what DP replicas (and TP ranks, for replicated tensors) hold alike, and on load reads
exactly the region every rank of the *new* layout asks for. That is the whole resharding story.

Keys::

    model.<logical name>                      parameters (the tied embedding once: logical_name) and
                                              persistent buffers (a router's expert bias)
    optimizer.<logical name>.{exp_avg,exp_avg_sq,step}   AdamW state, sharded like its parameter
    optimizer.<logical name>.momentum_buffer  Muon's (hidden matrices) or SGD's state instead of the moments
    optimizer.<logical name>.main_param       fp32 master weights (16-bit training only)
    rng.rank<k>.cpu.default                   per-rank CPU generator state (same layout only)
    rng.rank<k>.<device type>.{default,<tracker stream>}   the device's generator and the tracker's
                                              streams (same layout and same device type only: a CUDA
                                              state is 16 bytes, a CPU one 5056)

The iteration, LR schedule and data position are not tensors: the LR and the samples of an iteration are
pure functions of the iteration (``optim.learning_rate``, ``data/microbatch.py``), which ``ptdp.json``
records, beside the data state (``data/mix_state.py``: per dataset its identity, weight and consumed samples). RNG states only make sense on the rank that drew them, so they are restored only when t, p, d
and v are unchanged; in another layout every rank re-seeds from (seed, iteration) instead (exact anyway
with dropout off). Loading never unpickles anything but DCP's own metadata.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ptdp.checkpointing import optimizer_shards, storage
from ptdp.checkpointing.hf_dir import is_hf_dir
from ptdp.checkpointing.interface import Checkpointable
from ptdp.checkpointing.sharded import BoxLoadPlanner
from ptdp.checkpointing.validation import model_mismatch, model_shape, optimizer_mismatch
from ptdp.optim import MegatronOptimizer
from ptdp.parallel.placement import to_dtensor
from ptdp.parallel.tensor import random as tp_random


def _layout(run: Checkpointable) -> dict:
    """The layout ``ptdp.json`` records. Parameters and optimizer state are replicated over CP, as over
    DP (the distributed optimizer shards over the dp-cp group and :func:`optimizer_state` gathers over it),
    so c changes nothing in the saved tensors: it is recorded (only when c > 1, so c = 1 checkpoints keep
    their old layout) to tell a same-layout resume, whose RNG states apply, from a resharded one."""
    plan = run.plan
    layout = {"tensor_model_parallel_size": plan.t, "pipeline_model_parallel_size": plan.p,
              "data_parallel_size": plan.d, "virtual_pipeline_model_parallel_size": plan.v,
              "pipeline_schedule": plan.schedule}
    if plan.c > 1:
        layout["context_parallel_size"] = plan.c
    if plan.e > 1:
        layout["expert_model_parallel_size"] = plan.e
    return layout


def named_parameters(run: Checkpointable) -> Iterator[tuple[str, nn.Parameter]]:
    """(logical name, parameter) for every local parameter, the last stage's tied copy included."""
    for chunk in run.chunks:
        for param in chunk.parameters():
            yield run.placements[param].name, param


def named_buffers(run: Checkpointable) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, buffer) for every persistent buffer (a router's expert bias): replicated state that is not
    trained, saved and loaded whole like a replicated parameter. A chunk's module names are the full
    model's (layers under their global indices), so the name is already logical."""
    for chunk in run.chunks:
        for name, value in chunk.state_dict(keep_vars=True).items():
            if not isinstance(value, nn.Parameter):
                yield name, value


def _mesh_for(run: Checkpointable) -> Callable[[tuple[str, ...]], DeviceMesh | None]:
    """The mesh over the dimensions a placement's splits name (``to_dtensor``): the expert mesh's ``ep``
    and ``etp``, else the rank's mesh (``tp``; ``pp`` and ``tp`` for a vocabulary slice)."""
    meshes: dict[tuple[str, ...], DeviceMesh | None] = {}

    def mesh_for(axes: tuple[str, ...]) -> DeviceMesh | None:
        if axes not in meshes:
            expert = run.plan.groups.expert
            whole = expert.mesh if expert is not None and set(axes) <= {"ep", "etp"} else run.plan.groups.mesh
            meshes[axes] = None if whole is None else whole[axes]
        return meshes[axes]

    return mesh_for


def optimizer_state(optimizer: MegatronOptimizer) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
    """The logical per-parameter optimizer state, ``{param: {field..., step[, main_param]}}`` (the fields:
    ``optimizer.state_fields(param)``), each tensor shaped like its (local TP piece of the) parameter; empty
    before the first step. The distributed optimizer gathers its DP shards, a collective, so every rank
    calls this exactly once per save."""
    return optimizer.state_per_param()


def _rng_entries(rank: int) -> dict[str, torch.Tensor]:
    """This rank's generator states, keyed by device type: a checkpoint resumed on another device type
    has none of the new device's keys, so it re-seeds (as in another layout) instead of loading a CUDA
    state into a CPU generator (or the reverse)."""
    tracker = tp_random.get_rng_tracker()
    kind = tracker.device.type
    states = {"cpu.default": torch.get_rng_state()}
    if kind != "cpu":
        states[f"{kind}.default"] = tp_random._get_state(tracker.device)
    states.update({f"{kind}.{name}": state for name, state in tracker.get_states().items()})
    return {f"rng.rank{rank}.{name}": state for name, state in states.items()}


def save_state_dict(run: Checkpointable) -> dict[str, torch.Tensor]:
    """This rank's contribution to the checkpoint (tensors share storage with the live ones). Sharded
    state -- the distributed optimizer's, and the model's under ZeRO-3 -- is written as the boxes of
    the global tensors this rank owns (``optimizer_shards``): no rank gathers anything."""
    mesh_for = _mesh_for(run)
    pieces = optimizer_shards.owns_pieces(run.optimizer)  # sharded state: each rank writes its pieces
    sharded_model = run.model_sharded
    optim = {} if pieces else optimizer_state(run.optimizer)
    frozen = optimizer_shards.frozen_sharded(run.optimizer)  # ZeRO-3's shards of frozen weights (LoRA's base)
    out: dict[str, torch.Tensor] = {}
    for name, param in named_parameters(run):
        placement = run.placements[param]
        if placement.role == "embedding_copy":  # one copy of the tied embedding
            continue
        if (not sharded_model or not param.requires_grad) and param not in frozen:
            out[f"model.{name}"] = to_dtensor(param.detach(), placement, mesh_for)
        for key, tensor in optim.get(param, {}).items():
            out[f"optimizer.{name}.{key}"] = tensor if key == "step" else to_dtensor(tensor, placement, mesh_for)
    out.update({f"model.{name}": buffer.detach() for name, buffer in named_buffers(run)})
    out.update(optimizer_shards.frozen_boxes(run.optimizer, run.placements, copies=False))
    if pieces:
        out.update(optimizer_shards.save_entries(run.optimizer, run.placements, sharded_model))
    out.update(_rng_entries(run.plan.groups.rank))
    return out


def save_checkpoint(run: Checkpointable, iteration: int, writer=None, on_commit=None,
                    ours: frozenset[int] = frozenset()) -> Path:
    """Save atomically to ``--save``/iter_NNNNNNN and move ``latest`` (collective: every rank calls it).
    ``--keep-last`` prunes only among ``ours`` (the checkpoints of this run) and this one.

    ``writer`` (a :class:`~.saver.CheckpointWriter`) decides whether the write happens now or in the
    background (``--async-save``: this call then returns after copying the state, and ``on_commit(iteration,
    path, write_seconds)`` runs once ``latest`` moved). Without one, the save is written inline.
    """
    from ptdp.checkpointing.saver import CheckpointWriter, stage

    ck, rank = run.config.checkpoint, run.plan.groups.rank
    if writer is None:
        writer = CheckpointWriter(rank, run.plan.world, async_save=False)
    state_dict = save_state_dict(run)
    has_optimizer = any(key.startswith("optimizer.") for key in state_dict)  # the same on every rank
    info = None
    if rank == 0:
        info = {
            "iteration": iteration,
            "consumed_samples": run.data_position.consumed_samples(iteration),
            "data": run.data_position.state(iteration),  # ptdp/data/mix_state.py: what each dataset read
            "model": model_shape(run.config.model, run.chunks[0].vocab_size, _padded_vocab(run)),
            "layout": _layout(run),
            "contents": ["model", "rng"] + (["optimizer"] if has_optimizer else []),
            "config": run.config.to_dict(),
            "grad_scaler": _grad_scaler(run).state_dict() if _grad_scaler(run) else None,
            # fp16 overflows so far: the LR schedule stands at iteration - skipped_iterations
            "skipped_iterations": run.optimizer.skipped_iterations,
        }
    # A background write needs a private copy (the loop changes the live tensors at once); inline, none.
    staged = stage(state_dict) if writer.async_save else state_dict
    writer.submit(Path(ck.save), iteration, staged, info, ck.keep_last, on_commit, ours)
    return storage.iteration_dir(ck.save, iteration)


def load_checkpoint(run: Checkpointable, path: str | Path, model_only: bool = False) -> int | None:
    """Load ``path`` (a directory with ``latest``, or one iter_* directory) into this rank; returns the
    iteration it holds (0 for an imported model), None when nothing was saved yet. Collective when a
    checkpoint exists.

    ``model_only`` (``--pretrained-checkpoint``): the model's weights alone, as the start of a new run
    (iteration 0: no optimizer state, no RNG states); LoRA adapters the checkpoint lacks (a base model's)
    keep their fresh initial values.
    """
    reader = None
    if is_hf_dir(path):  # a Hugging Face directory: read as an imported checkpoint, each rank its slices
        from ptdp.checkpointing.hf_reader import open_hf_source

        directory = Path(path)
        info, reader = open_hf_source(path, run.config.model, run.chunks[0].vocab_size, _padded_vocab(run), run.plan.t)
    else:
        directory = storage.resolve(path)
        if directory is None:
            return None
        storage.verify_checksums(directory, hash_data=False)  # a no-op when the start-up check already did it
        from ptdp.checkpointing.saver import verify_data_files

        verify_data_files(directory, run.plan.groups.rank, run.plan.world)  # each rank a share
        info = storage.read_info(directory)
    problem = model_mismatch(info["model"], run.config.model, run.chunks[0].vocab_size,
                             run.plan.t) or (None if model_only else optimizer_mismatch(info, run.config))
    if problem:
        raise storage.CheckpointError(f"--load {directory}: {problem}")
    metadata = (reader or dcp.FileSystemReader(directory)).read_metadata().state_dict_metadata
    saved_keys = set(metadata)
    mesh_for = _mesh_for(run)
    request: dict[str, torch.Tensor] = {}
    targets: list[tuple[str, torch.Tensor]] = []  # (key, live tensor) to copy loaded values into

    def want(key: str, live: torch.Tensor, param: nn.Parameter, shard: bool = True) -> None:
        if key in request:  # a rank holding both copies of the tied embedding reads it once, then copies
            targets.append((key, live))
        else:  # DCP reads straight into the live tensor: no full-size staging copy of the model
            request[key] = to_dtensor(live, run.placements[param], mesh_for) if shard else live

    optim: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
    # --no-load-optim: the model only (the optimizer starts afresh, e.g. after changing --optimizer)
    load_optim = "optimizer" in info["contents"] and not run.config.checkpoint.no_load_optim and not model_only
    pieces = optimizer_shards.owns_pieces(run.optimizer) and load_optim
    sharded_model = run.model_sharded and not model_only  # ZeRO-3: into the parameter shards
    frozen = optimizer_shards.frozen_sharded(run.optimizer)  # read into their ZeRO-3 shards (below)
    for name, param in named_parameters(run):
        if model_only and param.requires_grad and (f"model.{name}" not in saved_keys or run.model_sharded):
            continue  # an adapter the base lacks (LoRA), or one ZeRO-3 shards: it starts fresh
        if param in frozen:
            continue
        master = f"optimizer.{name}.main_param"  # fp32 weights: from the fp32 master copy of a 16-bit run
        if not sharded_model or not param.requires_grad:
            want(master if param.dtype == torch.float32 and master in saved_keys else f"model.{name}",
                 param.detach(), param)
        trains = load_optim and not pieces and param.requires_grad  # a frozen weight (LoRA) has no state
        fields = (*run.optimizer.state_fields(param), "step", "main_param") if trains else ()
        for field in fields:
            key = f"optimizer.{name}.{field}"
            if key in saved_keys or field != "main_param":  # main_param only when the run had master weights
                live = torch.zeros((), dtype=torch.float32) if field == "step" else torch.empty_like(
                    param, dtype=torch.float32)
                optim.setdefault(param, {})[field] = live
                want(key, live, param, shard=field != "step")
    for name, buffer in named_buffers(run):
        want(f"model.{name}", buffer, None, shard=False)
    request.update(optimizer_shards.frozen_boxes(run.optimizer, run.placements, copies=True))
    same_layout = info["layout"] == _layout(run) and not model_only
    rng = _rng_entries(run.plan.groups.rank)
    if same_layout and all(key in saved_keys for key in rng):
        request.update({key: torch.empty_like(value) for key, value in rng.items()})
    install_pieces = None
    if pieces or sharded_model:  # only this rank's pieces, read straight into their live or new tensors
        extra, install_pieces = optimizer_shards.load_requests(
            run.optimizer, run.placements, saved_keys, model=sharded_model, state=pieces)
        request.update(extra)
    missing = sorted(set(request) - saved_keys)
    if missing:
        raise storage.CheckpointError(f"--load {directory}: the checkpoint has no {missing[0]} "
                                      f"({len(missing)} entries missing); it was saved by another model")
    resized = [k for k in request if tuple(getattr(metadata[k], "size", request[k].shape)) != tuple(request[k].shape)]
    if resized:  # e.g. another --num-experts: same names, other shapes
        raise storage.CheckpointError(
            f"--load {directory}: {resized[0]} is {tuple(metadata[resized[0]].size)} there, "
            f"{tuple(request[resized[0]].shape)} here ({len(resized)} tensors differ); it was saved by another "
            "model: pass its shape flags (--num-experts, --moe-ffn-hidden-size, ...)")
    _dcp_load(request, directory, reader)
    with torch.no_grad():
        for key, live in targets:
            loaded = request[key]
            live.copy_(loaded.to_local() if isinstance(loaded, DTensor) else loaded)
    run.optimizer.reload_model_params()  # master weights (if any) := the loaded model weights
    if optim:
        run.optimizer.load_state_per_param(optim)  # restores the fp32 master weights if saved
    if install_pieces is not None:
        install_pieces()  # restores the fp32 master weights if saved
    if info.get("grad_scaler") and _grad_scaler(run):
        _grad_scaler(run).load_state_dict(info["grad_scaler"])
    run.optimizer.skipped_iterations = 0 if model_only else int(info.get("skipped_iterations", 0))
    iteration = 0 if model_only else int(info["iteration"])
    if same_layout and rng.keys() <= request.keys():
        prefix = f"rng.rank{run.plan.groups.rank}."
        _restore_rng(run, {key.removeprefix(prefix): request[key] for key in rng})
    elif iteration > 0:  # at iteration 0 (an imported model) the fresh-start seeding is already right
        groups = run.plan.groups
        tp_random.model_parallel_seed(reseed(run.plan.seed, iteration), groups.tp_rank, groups.pp_rank,
                                      groups.device)
    return iteration


def reseed(seed: int, iteration: int) -> int:
    """The seed every rank re-derives its generators from when resuming in another layout."""
    return (seed * 1_000_003 + iteration) % (2**31)


def _restore_rng(run: Checkpointable, states: dict[str, torch.Tensor]) -> None:
    """Inverse of :func:`_rng_entries` (names without the ``rng.rank<k>.`` prefix)."""
    tracker = tp_random.get_rng_tracker()
    kind = tracker.device.type
    torch.set_rng_state(states.pop("cpu.default"))
    if kind != "cpu":
        tp_random._set_state(states.pop(f"{kind}.default"), tracker.device)
    tracker.set_states({name.removeprefix(f"{kind}."): state for name, state in states.items()})


def _padded_vocab(run: Checkpointable) -> int:
    return run.config.model.padded_vocab_size(run.chunks[0].vocab_size, run.plan.vocab_divisor)


def _grad_scaler(run: Checkpointable):
    """The fp16 loss scaler, if the optimizer has one (its few numbers go to ``ptdp.json``)."""
    return run.optimizer.scaler


def _dcp_load(state_dict: dict, directory: Path, reader=None) -> None:
    """DCP's load of ``state_dict`` from the checkpoint ``directory`` (or through ``reader``: an HF one)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state_dict, checkpoint_id=None if reader else directory, storage_reader=reader,
                 planner=BoxLoadPlanner())



