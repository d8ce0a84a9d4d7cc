"""The distributed optimizer's state in a checkpoint, written and read shard by shard.

Each rank saves only the :class:`~ptdp.optim.optimizer.ShardPiece` ranges it owns -- fp32 master
weights and the optimizer's state (``MegatronOptimizer.state_fields``: Adam's moments ``exp_avg``,
``exp_avg_sq``; Muon's and SGD's ``momentum_buffer``) -- as boxes of the logical (global) tensors
``optimizer.<name>.<field>`` (:mod:`.sharded`), and on load asks for exactly the boxes of the pieces it owns
in the new layout, read straight into freshly allocated piece-sized tensors that become the state. No
collective, and no tensor larger than a piece: the first version gathered every parameter's full fp32
state on every rank (12 bytes per parameter, ZeRO's savings undone at every save).

The keys and global shapes are those :func:`~.state.save_state_dict` always wrote, so checkpoints of
either kind load into any optimizer (a non-sharded one simply asks for whole parameters).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ptdp.checkpointing.sharded import add_boxes, piece_boxes
from ptdp.optim import kinds
from ptdp.optim.optimizer import DistributedOptimizer
from ptdp.parallel.placement import Placements


def owns_pieces(optimizer) -> bool:
    """Whether ``optimizer`` keeps its state as flat pieces (then this module saves and loads it)."""
    return isinstance(optimizer, DistributedOptimizer)


def _names(placements: Placements, copies: bool) -> dict[nn.Parameter, str]:
    """The full-model name of each of this rank's trained parameters (with ``copies``, the tied copy's too;
    a frozen one, LoRA's base weights, has no optimizer state)."""
    return {param: placements[param].name for param in placements
            if (copies or placements[param].role != "embedding_copy") and param.requires_grad}


def _boxes(x, flat: torch.Tensor, placements: Placements) -> tuple[torch.Size, list]:
    """(global shape, boxes) of piece ``x``'s values ``flat`` (a 1-D tensor as long as the piece)."""
    placement, local = placements[x.param], tuple(x.param.shape)
    return placement.full_shape(local), piece_boxes(flat.detach().reshape(-1), local, x.start - x.param_offset,
                                                    placement.offset(local))


def save_entries(optimizer: DistributedOptimizer, placements: Placements, model: bool = False) -> dict:
    """This rank's entries: boxes of its pieces (views, no copy) -- the optimizer's master weights and
    state, and every parameter's ``step`` (none before the first step); with ``model`` (ZeRO-3) the
    model's weights ``model.<name>`` too. ``placements``: where each of this rank's parameters lives."""
    names = _names(placements, copies=False)  # one copy of the tied embedding, as for the model
    out: dict = {}
    if optimizer.steps:
        step = torch.tensor(float(optimizer.steps), dtype=torch.float32)
        out.update({f"optimizer.{name}.step": step for name in names.values()})
    for x in optimizer.pieces:
        name = names.get(x.param)
        if name is None:
            continue
        state = optimizer.optimizer.state.get(x.main) or {}
        fields = [("model", x.model_view)] if model else []
        if optimizer.steps:
            fields += [("optimizer.main_param", x.main)]
            fields += [(f"optimizer.{k}", state.get(k)) for k in optimizer.state_fields(x.param)]
        for field, flat in fields:
            if flat is not None:
                prefix, _, suffix = field.partition(".")
                add_boxes(out, f"{prefix}.{name}" + (f".{suffix}" if suffix else ""), *_boxes(x, flat, placements))
    return out


def load_requests(optimizer: DistributedOptimizer, placements: Placements, saved_keys: set[str],
                  model: bool = False, state: bool = True) -> tuple[dict, Callable[[], None]]:
    """What this rank asks DCP for and the function that installs the loaded values once DCP filled them.

    ``state``: the optimizer's pieces (master weights, its state fields; every parameter's ``step``), read
    into new piece-sized tensors that become the optimizer's state. ``model`` (ZeRO-3): the model's weights, read
    straight into the persistent parameter shards (fp32 weights from the fp32 master copy when the
    checkpoint has one). Call the installer after the rest of the model is in place.
    """
    names = _names(placements, copies=True)  # the last stage's tied copy has its own pieces and state
    request: dict = {}
    steps = {f"optimizer.{name}.step" for name in names.values()} & saved_keys if state else set()
    for key in steps:
        request[key] = torch.zeros((), dtype=torch.float32)
    filled: list[tuple] = []
    for x in optimizer.pieces:
        name = names[x.param]
        shares_model = x.main.data_ptr() == x.model_view.data_ptr()  # fp32: the model's weights are the master
        if model:
            master = f"optimizer.{name}.main_param"
            key = master if x.model_view.dtype == torch.float32 and master in saved_keys else f"model.{name}"
            add_boxes(request, key, *_boxes(x, x.model_view, placements))
        fields = {}
        for field in (*optimizer.state_fields(x.param), "main_param") if state else ():
            key = f"optimizer.{name}.{field}"
            if field == "main_param" and (key not in saved_keys or shares_model):
                continue
            fields[field] = torch.empty(x.end - x.start, dtype=torch.float32, device=x.main.device)
            add_boxes(request, key, *_boxes(x, fields[field], placements))
        filled.append((x, fields))

    @torch.no_grad()
    def install() -> None:
        values = {int(request[key]) for key in steps}
        if len(values) > 1:
            raise ValueError(f"the checkpoint's parameters are at different Adam steps {sorted(values)}")
        if not values:
            return
        optimizer.steps = values.pop()
        for x, fields in filled:
            kinds.install_state(optimizer.optimizer, x.main, {k: fields[k] for k in optimizer.state_fields(x.param)},
                                optimizer.steps)
            if "main_param" in fields:
                x.main.copy_(fields["main_param"])
                if x.main.data_ptr() != x.model_view.data_ptr():
                    x.model_view.copy_(x.main)

    return request, install


def frozen_sharded(optimizer) -> set[nn.Parameter]:
    """The frozen parameters (LoRA's base) whose weights ZeRO-3 keeps as shards (``FlatBuffer.frozen_buckets``)."""
    grads = getattr(optimizer, "grads", None)
    return {p for b in (grads.frozen_buckets if grads is not None else ()) for p in b.params}


def frozen_boxes(optimizer, placements: Placements, copies: bool) -> dict:
    """``model.<name>`` boxes of this rank's shards of the frozen parameters (views of the shards: a save
    writes them, a load fills them in place); ``copies``: the tied copy's too (a load)."""
    grads = getattr(optimizer, "grads", None)
    out: dict = {}
    for b in grads.frozen_buckets if grads is not None else ():
        for p, offset in zip(b.params, b.offsets, strict=True):
            lo, hi = max(offset, b.shard_start), min(offset + p.numel(), b.shard_end)
            placement = placements[p]
            if lo >= hi or (not copies and placement.role == "embedding_copy"):
                continue
            local = tuple(p.shape)
            flat = b.param_shard[lo - b.shard_start:hi - b.shard_start]
            add_boxes(out, f"model.{placement.name}", placement.full_shape(local),
                      piece_boxes(flat, local, lo - offset, placement.offset(local)))
    return out
