"""The distributed optimizer's state in a checkpoint, written and read shard by shard.

Each rank saves only the :class:`~ptdp.optim.optimizer.ShardPiece` ranges it owns -- fp32 master
weights and Adam moments -- as boxes of the logical (global) tensors ``optimizer.<name>.{main_param,
exp_avg,exp_avg_sq}`` (:mod:`.sharded`), and on load asks for exactly the boxes of the pieces it owns in
the new layout, read straight into freshly allocated piece-sized tensors that become AdamW's state. No
collective, and no tensor larger than a piece: the first version gathered every parameter's full fp32
state on every rank (12 bytes per parameter, ZeRO's savings undone at every save).

The keys and global shapes are those :func:`~.state.save_state_dict` always wrote, so checkpoints of
either kind load into any optimizer (a non-sharded one simply asks for whole parameters).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..optim.optimizer import DistributedOptimizer
from .sharded import add_boxes, piece_boxes, tp_geometry


def owns_pieces(optimizer) -> bool:
    """Whether ``optimizer`` keeps its state as flat pieces (then this module saves and loads it)."""
    return isinstance(optimizer, DistributedOptimizer)


def _names(named: list[tuple[str, nn.Parameter]], copies: bool) -> dict[nn.Parameter, str]:
    return {param: name for name, param in named if copies or not getattr(param, "is_embedding_copy", False)}


def save_entries(optimizer: DistributedOptimizer, named: list[tuple[str, nn.Parameter]], tp_rank: int,
                 tp_size: int) -> dict:
    """This rank's optimizer entries: boxes of its pieces (views, no copy) and every parameter's ``step``;
    empty before the first step. ``named``: (logical name, parameter) of this rank's parameters."""
    if optimizer.adam_steps == 0:
        return {}
    names = _names(named, copies=False)  # one copy of the tied embedding, as for the model
    step = torch.tensor(float(optimizer.adam_steps), dtype=torch.float32)
    out: dict = {f"optimizer.{name}.step": step for name in names.values()}
    for x in optimizer.pieces:
        name = names.get(x.param)
        if name is None:
            continue
        shape, offset = tp_geometry(x.param, tp_rank, tp_size)
        state = optimizer.optimizer.state.get(x.main) or {}
        for field, flat in (("main_param", x.main), ("exp_avg", state.get("exp_avg")),
                            ("exp_avg_sq", state.get("exp_avg_sq"))):
            if flat is not None:
                add_boxes(out, f"optimizer.{name}.{field}", shape,
                          piece_boxes(flat.detach().reshape(-1), tuple(x.param.shape), x.start - x.param_offset,
                                      offset))
    return out


def load_requests(optimizer: DistributedOptimizer, named: list[tuple[str, nn.Parameter]], tp_rank: int,
                  tp_size: int, saved_keys: set[str]) -> tuple[dict, Callable[[], None]]:
    """What this rank asks DCP for (its pieces' boxes, every parameter's ``step``) and the function that
    installs the loaded values as the optimizer's state once DCP filled them (call it after the model's
    weights are in place: the master weights of a 16-bit model overwrite its pieces)."""
    names = _names(named, copies=True)  # the last stage's tied copy has its own pieces and state
    request: dict = {}
    steps = {f"optimizer.{name}.step" for name in names.values()} & saved_keys
    for key in steps:
        request[key] = torch.zeros((), dtype=torch.float32)
    filled: list[tuple] = []
    for x in optimizer.pieces:
        name = names[x.param]
        shape, offset = tp_geometry(x.param, tp_rank, tp_size)
        shares_model = x.main.data_ptr() == x.model_view.data_ptr()  # fp32: the model's weights are the master
        fields = {}
        for field in ("exp_avg", "exp_avg_sq", "main_param"):
            key = f"optimizer.{name}.{field}"
            if key not in saved_keys or (field == "main_param" and shares_model):
                continue
            fields[field] = torch.empty(x.end - x.start, dtype=torch.float32, device=x.main.device)
            add_boxes(request, key, shape, piece_boxes(fields[field], tuple(x.param.shape),
                                                       x.start - x.param_offset, offset))
        filled.append((x, fields))

    @torch.no_grad()
    def install() -> None:
        values = {int(request[key]) for key in steps}
        if len(values) > 1:
            raise ValueError(f"the checkpoint's parameters are at different Adam steps {sorted(values)}")
        if not values:
            return
        optimizer.adam_steps = values.pop()
        for x, fields in filled:
            if "exp_avg" in fields and "exp_avg_sq" in fields:
                fused = x.main.device.type != "cpu"  # fused (CUDA) AdamW wants its step beside the parameter
                optimizer.optimizer.state[x.main] = {
                    "step": torch.tensor(float(optimizer.adam_steps), dtype=torch.float32,
                                         device=x.main.device if fused else None),
                    "exp_avg": fields["exp_avg"], "exp_avg_sq": fields["exp_avg_sq"]}
            if "main_param" in fields:
                x.main.copy_(fields["main_param"])
                if x.main.data_ptr() != x.model_view.data_ptr():
                    x.model_view.copy_(x.main)

    return request, install
