"""The Megatron distributed optimizer's state, read from a save into ptdp's per-parameter form.

Megatron-Core (``DistributedOptimizer.sharded_state_dict``) saves the Adam state in one of several formats,
named in ``common.pt`` (``optimizer.param_state_sharding_type``):

- ``fully_reshardable`` (Megatron-LM's ``--dist-ckpt-optim-fully-reshardable``): per parameter, tensors
  keyed ``optimizer.state.<field>.<the parameter's key>`` with the parameter's own global shape (layers
  stacked as the model's are), fields ``exp_avg``, ``exp_avg_sq`` and the fp32 main weights (``param``).
  These map onto parameters exactly as the model's tensors do, so ptdp imports them.
- ``dp_reshardable`` (Megatron-LM's default): per model-parallel rank, buffer and bucket one flat tensor per
  field, laid out as Megatron's gradient buckets; the layout is not written in the checkpoint, so
  ``ptdp.megatron.buckets`` rebuilds it from the args and the model's tensors, checks it against the bucket
  sizes and piece boundaries the save does record, and each parameter's slice (per tensor-parallel rank,
  joined as the model's tensors are) becomes the per-parameter state ``fully_reshardable`` would have held.
  The param groups (Adam's step) are a pickled object per rank there, not ``common.pt``'s.
- ``dp_zero_gather_scatter``: the same buffers gathered on data-parallel rank 0 into one pickled object per
  rank; refused by name. The torch format's ``mp_rank_*/distrib_optim.pt`` is that gather too, a file per
  rank, and is read (:func:`read_distrib_optim`).

``fully_reshardable`` is built by megatron-core (0.16.1) from that gather, which drops each bucket's end
padding, but cut at the parameters' offsets in the padded buffer: from several buckets its values are
shifted, and ptdp refuses it there (``ptdp.megatron.buckets.shifted_by_padding``).
- ``fully_sharded_model_space`` (megatron-core's own default when no format is asked for): flattened
  pieces of each parameter. megatron-core 0.16.1 cannot save it (``flattened_range is not supported``);
  an older version's is refused by name, unverified.

Adam's step count is not a tensor: it is each param group's ``step`` in ``common.pt``'s
``optimizer.optimizer.param_groups``. The LR scheduler's position (``opt_param_scheduler.num_steps``,
counted in samples) must be the run's consumed samples: ptdp's learning rate is a function of the
iteration, so the import checks that they agree and prints the scheduler's flags.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ptdp.megatron.args import MegatronError

if TYPE_CHECKING:
    import torch

    from ptdp.config import ModelConfig, MoEConfig


class MegatronCheckpoint(Protocol):
    """What is read here of a save (``ptdp.megatron.read.MegatronCheckpoint``, which imports this module)."""

    directory: Path
    args: dict[str, Any]
    optimizer: dict[str, dict[str, Any]]
    common: dict[str, Any]

STATE_PREFIX = "optimizer.state."
SUPPORTED = ("fully_reshardable", "dp_reshardable")
BUCKETS = "optimizer.distributed."
_BUCKET_KEY = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)\.(\w+)$")


def _sharding_type(common: Any) -> str | None:
    optimizer = common.get("optimizer") if isinstance(common, dict) else None
    return optimizer.get("param_state_sharding_type") if isinstance(optimizer, dict) else None


def check_optimizer_format(directory: Path, common: Any, entries: dict) -> str:
    """The optimizer state's format; one ptdp cannot map onto parameters is refused in one line naming it."""
    kind = _sharding_type(common)
    buckets = any(_BUCKET_KEY.match(key) for key in entries)
    if kind is None:
        kind = "dp_reshardable" if buckets else None
    if kind in SUPPORTED and (buckets if kind == "dp_reshardable" else any(k.startswith(STATE_PREFIX) for k in entries)):
        return kind
    what = f"in the {kind!r} format" if kind else "in a format ptdp does not know (no per-parameter state)"
    raise MegatronError(f"--in {directory}: holds the distributed optimizer's state {what}, laid out by Megatron's "
                        f"gradient buffers or as flattened pieces; ptdp imports {' and '.join(map(repr, SUPPORTED))} (Megatron-LM's "
                        "default, or --dist-ckpt-optim-fully-reshardable), or pass --no-load-optim to start the optimizer afresh")


def adam_steps(ckpt: MegatronCheckpoint) -> int:
    """The Adam step count every param group agrees on (common.pt's param groups)."""
    optimizer = ckpt.common.get("optimizer", {}).get("optimizer", {})
    steps = {group.get("step") for group in optimizer.get("param_groups", [])}
    if len(steps) != 1 or None in steps:
        raise MegatronError(f"--in {ckpt.directory}: common.pt's optimizer param groups give Adam steps "
                            f"{sorted(map(str, steps))}, not one count")
    return int(steps.pop())


def check_optimizer_args(ckpt: MegatronCheckpoint, consumed: int) -> dict[str, Any]:
    """Refuse what ptdp's AdamW and LR schedule would not continue exactly; the optimizer flags (Megatron's
    names) the run goes on with, its scheduler's where ``common.pt`` holds one."""
    args, where = ckpt.args, f"--in {ckpt.directory}"
    for name, allowed in (("optimizer", "adam"), ("decoupled_weight_decay", True), ("fp16", False),
                          ("weight_decay_incr_style", "constant"), ("lr_warmup_fraction", None),
                          ("lr_warmup_samples", 0), ("lr_warmup_init", 0.0), ("lr_decay_samples", None), ("train_samples", None),
                          ("use_precision_aware_optimizer", False), ("optimizer_cpu_offload", False)):
        value = args.get(name, allowed)
        if value != allowed and not (allowed in (None, 0, False) and not value):
            raise MegatronError(f"{where}: the checkpoint's args set {name}={value!r}; ptdp does not continue that "
                                "optimizer exactly (pass --no-load-optim to start afresh)")
    flags = {k: args[k] for k in ("lr", "min_lr", "lr_decay_style", "lr_warmup_iters", "lr_decay_iters",
                                  "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad")
             if args.get(k) is not None}
    scheduler = ckpt.common.get("opt_param_scheduler")
    if isinstance(scheduler, dict):
        if int(scheduler.get("num_steps", consumed)) != consumed:
            raise MegatronError(f"{where}: opt_param_scheduler num_steps {scheduler['num_steps']} is not the "
                                f"consumed samples {consumed}; ptdp's schedule stands at the iteration")
        if scheduler.get("start_wd") != scheduler.get("end_wd"):
            raise MegatronError(f"{where}: opt_param_scheduler changes the weight decay ({scheduler.get('start_wd')} "
                                f"to {scheduler.get('end_wd')}); ptdp's is constant")
        batch = int(args.get("global_batch_size") or 1)
        flags.update(lr=scheduler.get("max_lr", flags.get("lr")), min_lr=scheduler.get("min_lr", flags.get("min_lr")),
                     lr_decay_style=scheduler.get("lr_decay_style", flags.get("lr_decay_style")),
                     weight_decay=scheduler.get("end_wd", flags.get("weight_decay")))
        for key, name in (("lr_warmup_steps", "lr_warmup_iters"), ("lr_decay_steps", "lr_decay_iters")):
            if scheduler.get(key) is not None:  # counted in samples there, in iterations here
                if int(scheduler[key]) % batch:
                    raise MegatronError(f"{where}: opt_param_scheduler {key} {scheduler[key]} is not a whole number "
                                        f"of global batches ({batch}); ptdp's schedule counts iterations")
                flags[name] = int(scheduler[key]) // batch
    if flags.get("lr_decay_style", "linear") not in ("cosine", "linear", "constant"):
        raise MegatronError(f"{where}: lr_decay_style {flags['lr_decay_style']!r}; ptdp decays cosine, linear or "
                            "constant (pass --no-load-optim to start afresh)")
    return flags


def optimizer_to_ptdp(ckpt: MegatronCheckpoint, cfg: ModelConfig, moe: MoEConfig, rows: int) -> dict[str, dict]:
    """``{ptdp parameter name: {exp_avg, exp_avg_sq, step[, main_param]}}`` from the save's per-parameter
    state; ``rows``: the vocabulary rows ptdp keeps (Megatron padded for its t)."""
    import torch

    from ptdp.megatron.buckets import shifted_by_padding
    from ptdp.megatron.names import to_ptdp

    kind = _sharding_type(ckpt.common)
    try:
        shifted = kind == "fully_reshardable" and shifted_by_padding({k: tuple(v.shape) for k, v in ckpt.tensors.items()},
                                                                     ckpt.args)
    except MegatronError as e:
        raise MegatronError(f"--in {ckpt.directory}: whether its fully_reshardable optimizer state is intact depends "
                            f"on Megatron's gradient-bucket layout, which ptdp cannot rebuild: {str(e).split(': ', 1)[-1]}") from None
    if shifted:
        raise MegatronError(f"--in {ckpt.directory}: its fully_reshardable optimizer state comes from several gradient "
                            "buckets, which megatron-core gathers without their end padding and then slices at padded "
                            "offsets: the values are shifted; save in Megatron-LM's default format (dp_reshardable), "
                            "or pass --no-load-optim to start the optimizer afresh")
    steps = torch.tensor(float(adam_steps(ckpt)))
    fields = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
    if ckpt.args.get("bf16"):  # 16-bit weights: the fp32 master copy is the truth ptdp resumes from
        fields["param"] = "main_param"
    missing = [name for name in ("exp_avg", "exp_avg_sq") if name not in ckpt.optimizer]
    if missing:
        raise MegatronError(f"--in {ckpt.directory}: the optimizer's state has no {missing[0]} (Adam's); it holds "
                            f"{sorted(ckpt.optimizer)}")
    out: dict[str, dict[str, torch.Tensor]] = {}
    for theirs, ours in fields.items():
        if theirs not in ckpt.optimizer:
            continue
        for name, value in to_ptdp(ckpt.optimizer[theirs], cfg, moe).items():
            if name in ("embedding.word_embeddings.weight", "lm_head.weight") and value.shape[0] > rows:
                value = value[:rows]
            out.setdefault(name, {"step": steps})[ours] = value.float()
    return out


def _unwrap(value: Any) -> Any:
    """A ShardedObject of global shape (1,) reads back as a one-element list around the object saved."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def read_dp_reshardable(directory: Path, entries: dict, args: dict[str, Any],
                        shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, dict[str, torch.Tensor]], list[dict]]:
    """``{field: {Megatron per-layer name: full tensor}}`` and the param groups of a ``dp_reshardable`` save:
    each rank's buckets cut along the layout ``ptdp.megatron.buckets`` rebuilds (``shapes``: the model's
    full per-layer tensors), the tensor-parallel pieces joined."""
    import io

    import torch
    import torch.distributed.checkpoint as dcp

    from ptdp.megatron.buckets import bucket_layout, layout_args, rank_params

    where = f"--in {directory}"
    dp, size, high_busbw = layout_args(args)
    t, p = int(args.get("tensor_model_parallel_size") or 1), int(args.get("pipeline_model_parallel_size") or 1)
    found: dict[int, dict[tuple[int, str, int], dict[str, str]]] = {}
    for key in entries:
        if (match := _BUCKET_KEY.match(key)) is not None:
            group, gbuf, dtype, bucket, field = match.groups()
            if int(gbuf) or "float8" in dtype or "uint8" in dtype:
                raise MegatronError(f"{where}: its optimizer state has the buffer {key.rsplit('.', 2)[0]}; ptdp rebuilds "
                                    "one buffer of one dtype per rank (save with --dist-ckpt-optim-fully-reshardable)")
            found.setdefault(int(group), {}).setdefault((0, dtype, int(bucket)), {})[field] = key
    if sorted(found) != list(range(t * p)):
        raise MegatronError(f"{where}: its optimizer state has the model-parallel ranks {sorted(found)}, not the "
                            f"{t * p} of t={t}, p={p}; the save is partial")
    objects = {f"{BUCKETS}dp_group_idx_{g}.{what}": None for g in found for what in ("per_bucket_numel_unpadded", "optimizer")}
    stored = {key.split("/", 1)[0]: key for key in entries if key.split("/", 1)[0] in objects}
    missing = sorted(set(objects) - set(stored))
    if missing:
        raise MegatronError(f"{where}: its optimizer state lacks {missing[0]}; the save is partial")
    loaded: dict[str, Any] = {key: io.BytesIO() for key in stored.values()}
    tensors = {key: torch.empty(tuple(entries[key].size), dtype=entries[key].properties.dtype)
               for buckets in found.values() for fields in buckets.values() for key in fields.values()}
    state = {**loaded, **tensors}
    dcp.load(state, checkpoint_id=directory, no_dist=True)
    for key in loaded:  # pickled by Megatron (dtypes as dict keys): trusted like the args in common.pt
        if isinstance(state[key], io.BytesIO):
            state[key].seek(0)
            loaded[key] = torch.load(state[key], map_location="cpu", weights_only=False)
        else:
            loaded[key] = state[key]
    out: dict[str, dict[str, list]] = {}
    groups: list[dict] = []
    for pp in range(p):
        for tp in range(t):
            g = tp + t * pp  # Megatron's rank in the tensor x pipeline group
            layout = bucket_layout(rank_params(shapes, args, tp, pp), dp, size if pp == 0 else None, high_busbw)
            recorded = _unwrap(loaded[stored[f"{BUCKETS}dp_group_idx_{g}.per_bucket_numel_unpadded"]])
            numels = [n for buffer in recorded if isinstance(buffer, dict) for per in buffer.values() for n in per] \
                if isinstance(recorded, list) else None
            if numels != [b.numel_unpadded for b in layout] or len(found[g]) != len(layout):
                raise MegatronError(f"{where}: rank {g}'s gradient buckets hold {numels} elements, ptdp's rebuilt "
                                    f"layout {[b.numel_unpadded for b in layout]}; an arg that changes Megatron's "
                                    "buffer layout is not understood (save with --dist-ckpt-optim-fully-reshardable)")
            groups += _unwrap(loaded[stored[f"{BUCKETS}dp_group_idx_{g}.optimizer"]]).get("param_groups", [])
            for (_, _, b), fields in sorted(found[g].items()):
                # the pieces the ranks wrote start and end at parameters, paddings and data-parallel shard edges
                cuts = {int(c.offsets[0]) + k * int(c.sizes[0]) for key in fields.values() for c in entries[key].chunks
                        for k in (0, 1)}
                shard = layout[b].numel // dp
                for name, (start, end) in layout[b].places.items():
                    if not {start, end} <= cuts or any(start < c < end and c % shard for c in cuts):
                        raise MegatronError(f"{where}: rank {g}'s bucket {b} has no piece at [{start}, {end}) for "
                                            f"{name}; the rebuilt gradient-buffer layout does not match the save")
                    for field, key in fields.items():
                        _place(out, field, name, tp, tensors[key][start:end], shapes, t)
    return _joined(out, args), groups


def _place(out: dict, field: str, name: str, tp: int, flat: torch.Tensor, shapes: dict, t: int) -> None:
    """Rank ``tp``'s slice of parameter ``name`` (flat, from a bucket) into ``out[field][name][tp]``."""
    from ptdp.megatron.names import EMBEDDING, split_dim

    local = list(shapes[name] if name in shapes else shapes[EMBEDDING])  # a tied output layer: the embedding's
    if (dim := split_dim(name)) is not None:
        local[dim] //= t
    out.setdefault(field, {}).setdefault(name, [None] * t)[tp] = flat.reshape(local)


def _joined(out: dict, args: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    from ptdp.megatron.names import join_slices as _join

    swiglu = bool(args.get("swiglu"))
    return {field: {name: _join(name, parts, swiglu) for name, parts in per.items()} for field, per in out.items()}


def read_distrib_optim(directory: Path, args: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                       states: dict[tuple[int, int], Any]) -> dict[str, dict[str, torch.Tensor]]:
    """``{field: {Megatron per-layer name: full tensor}}`` from the ``torch`` format's
    ``mp_rank_*/distrib_optim.pt``: per (``tp``, ``pp``) rank the buffer gathered on data-parallel rank 0,
    its buckets one after the other without their end padding (``states``: each rank's file, loaded). Only
    the buffer's total length is recorded, so that is what the rebuilt layout is checked against."""
    from ptdp.megatron.buckets import bucket_layout, layout_args, rank_params

    dp, size, high_busbw = layout_args(args)
    t = int(args.get("tensor_model_parallel_size") or 1)
    out: dict[str, dict[str, list]] = {}
    for (tp, pp), state in sorted(states.items()):
        where = f"--in {directory}: mp_rank_{tp:02d}_{pp:03d}'s distrib_optim.pt"
        buffers = {k: v for k, v in state.items() if isinstance(k, int)} if isinstance(state, dict) else {}
        if not state.get("buckets_coalesced") or list(buffers) != [0] or len(buffers[0]) != 1:
            raise MegatronError(f"{where} holds {sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__}; "
                                "ptdp reads one coalesced buffer of one dtype per rank")
        (world,) = buffers[0].values()
        layout = bucket_layout(rank_params(shapes, args, tp, pp), dp, size if pp == 0 else None, high_busbw)
        total = sum(b.numel_unpadded for b in layout)
        if world.get("numel_unpadded") != total or any(world[f].numel() != total for f in ("param", "exp_avg", "exp_avg_sq")):
            raise MegatronError(f"{where} holds a buffer of {world.get('numel_unpadded')} elements, ptdp's rebuilt layout "
                                f"{total}; an arg that changes Megatron's buffer layout is not understood")
        offset = 0
        for bucket in layout:
            for name, (start, end) in bucket.places.items():
                for field in ("param", "exp_avg", "exp_avg_sq"):
                    _place(out, field, name, tp, world[field][offset + start:offset + end], shapes, t)
            offset += bucket.numel_unpadded
    return _joined(out, args)
