"""Muon (Keller Jordan 2024; Moonshot, "Muon is scalable", 2025) on this rank's pieces of the hidden matrices.

Per matrix W with gradient G (docs/references.md, §Muon; Megatron-Core's ``TensorParallelMuon`` and
``torch.optim.Muon``, which agree on these):

    M ← μM + (1 − μ)G                      (``--muon-momentum`` μ; torch: ``buf.lerp_(grad, 1 - μ)``)
    X = G + μ(M − G) with ``--muon-nesterov``, else M
    O = scale(m, n) · NS(X)                (``ptdp.optim.newton_schulz``; NS of the whole m×n matrix)
    W ← W(1 − lr·wd) − lr·O                (decoupled weight decay, as AdamW's)

The momentum and both element-wise lines run on whatever this rank holds -- the whole parameter, or under
ZeRO its shard (so M is sharded exactly like Adam's moments, 4 bytes per parameter instead of 8) -- and the
orthogonalisation goes through :class:`~ptdp.optim.muon_exchange.Exchange`, which assembles each matrix on one
rank and hands back each rank's range of O. With ``--optimizer-cpu-offload`` M and the element-wise momentum
live on the host (4 bytes per parameter of host memory); X goes to the device for the exchange and NS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ptdp.config import OptimizerConfig
from ptdp.optim.eager import Eager
from ptdp.optim.muon_exchange import ROLES, Exchange, Grid, Shards
from ptdp.optim.muon_units import QKVLayout, Unit, is_hidden_matrix, units_of
from ptdp.optim.newton_schulz import coefficient_schedule, newton_schulz
from ptdp.parallel.placement import Placement, Placements


@dataclass(frozen=True)
class MuonLayout:
    """Where the hidden matrices lie over the ranks (the defaults: one process). ``tp_groups[role]``: the
    tensor-parallel group that splits a ``dense``/``expert`` matrix; ``dp_of(param)``: its data-parallel group
    and :class:`Shards` (from the gradient reducer's buckets); ``qkv``: grouped-query attention's row order;
    ``params``: every parameter of this rank (default: those stepped here), held here or not -- under ZeRO a
    rank may hold no piece of a matrix it must still help assemble."""

    params: tuple[nn.Parameter, ...] = ()
    tp_groups: dict[str, object] = field(default_factory=dict)
    dp_of: Callable[[nn.Parameter], tuple[object, Shards]] | None = None
    qkv: QKVLayout | None = None
    device: torch.device | None = None

    def is_matrix(self, param: nn.Parameter, placements: Placements) -> bool:
        return is_hidden_matrix(placement_of(param, placements), param)

    def dp(self, param: nn.Parameter) -> tuple[object, Shards]:
        return (None, Shards(0, param.numel(), 1)) if self.dp_of is None else self.dp_of(param)


def placement_of(param: nn.Parameter, placements: Placements) -> Placement:
    """``param``'s record; a parameter nobody recorded (a plain model) is whole, dense, decayed by shape."""
    found = placements.get(param)
    return found if found is not None else Placement(f"param{id(param)}", weight_decay=param.dim() >= 2)


class Muon(Eager, torch.optim.Optimizer):
    """Muon over tensors that are this rank's pieces of hidden matrices (module docstring). ``origin[t] =
    (param, start)``: the parameter tensor ``t`` is a piece of, and where the piece starts in its ``view(-1)``."""

    def __init__(self, groups: list[dict], origin: dict[torch.Tensor, tuple[nn.Parameter, int]], exchange: Exchange,
                 *, lr: float, momentum: float, nesterov: bool, host: bool = False):
        super().__init__(groups, {"lr": lr, "weight_decay": 0.0})
        self.origin, self.exchange = origin, exchange
        self.momentum, self.nesterov, self.host = momentum, nesterov, host

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("Muon.step takes no closure")
        inputs: dict[nn.Parameter, tuple[int, torch.Tensor]] = {}
        for group in self.param_groups:
            for t in group["params"]:
                grad = t.grad.to("cpu") if self.host else t.grad
                state = self.state[t]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                buf = state["momentum_buffer"]
                buf.lerp_(grad, 1 - self.momentum)
                x = grad.lerp(buf, self.momentum) if self.nesterov else buf
                param, start = self.origin[t]
                inputs[param] = (start, x.reshape(-1).to(t.device, non_blocking=True))
        updates = self.exchange.orthogonalize(inputs)  # collective: every rank, pieces or none
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for t in group["params"]:
                if wd:
                    t.mul_(1 - lr * wd)
                t.add_(updates[self.origin[t][0]].view_as(t), alpha=-lr)
        return None


def orthogonalizer(cfg: OptimizerConfig) -> Callable[[torch.Tensor, Unit], torch.Tensor]:
    """The owner's work on one full unit: Newton–Schulz on each of its matrices, scaled (``--muon-*``)."""
    schedule = coefficient_schedule(cfg.muon_coefficient_type, cfg.muon_num_ns_steps)

    def run(full: torch.Tensor, unit: Unit) -> torch.Tensor:
        rows = full.reshape(-1, full.shape[-1])
        out = torch.empty_like(rows)
        for m in unit.matrices:
            if m.ranges is None:
                out.copy_(newton_schulz(rows, schedule, cfg.muon_fp32_matmul_prec).mul_(m.scale))
                continue
            index = torch.cat([torch.arange(lo, hi, device=rows.device) for lo, hi in m.ranges])
            out[index] = newton_schulz(rows[index], schedule, cfg.muon_fp32_matmul_prec).mul_(m.scale)
        return out.view(full.shape)

    return run


def muon(stepped: list[tuple[torch.Tensor, nn.Parameter, int]], cfg: OptimizerConfig, placements: Placements,
         layout: MuonLayout) -> Muon:
    """Muon over ``stepped`` ((tensor, parameter, start) of this rank's pieces of the hidden matrices), its
    matrices spread over ``layout``'s grids (one per role whose matrices this rank has)."""
    units: dict[str, list[Unit]] = {role: [] for role in ROLES}
    shards: dict[nn.Parameter, Shards] = {}
    dp_groups: dict[str, object] = {}
    params = layout.params or tuple(dict.fromkeys(p for _, p, _ in stepped))
    for param in params:
        placement = placement_of(param, placements)
        if not is_hidden_matrix(placement, param):
            continue
        role = "expert" if placement.role == "expert" else "dense"
        units[role] += units_of(param, placement, qkv=layout.qkv, split_qkv=cfg.muon_split_qkv,
                                scale_mode=cfg.muon_scale_mode, extra_scale=cfg.muon_extra_scale_factor)
        dp_groups[role], shards[param] = layout.dp(param)
    device = layout.device or (stepped[0][0].device if stepped else torch.device("cpu"))
    grids = [Grid(units[role], shards, layout.tp_groups.get(role), dp_groups.get(role), cfg.muon_num_ns_steps)
             for role in ROLES if units[role]]
    exchange = Exchange(grids, orthogonalizer(cfg), device)
    decay = [t for t, p, _ in stepped if placements.decays(p)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": [t for t, p, _ in stepped if not placements.decays(p)], "weight_decay": 0.0}]
    return Muon(groups, {t: (p, start) for t, p, start in stepped}, exchange, lr=cfg.lr,
                momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov, host=cfg.optimizer_cpu_offload)
