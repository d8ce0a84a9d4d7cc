"""The process groups of the MoE layers: MoE Parallel Folding (Megatron-Core).

Attention keeps its ``t × c × d × p`` layout (``dims.py``); the MoE layers see the *same* ranks as
``etp × e × edp × p``, ordered as Megatron-Core's expert rank generator orders them ("tp-ep-dp-pp",
context parallelism folded away): expert-tensor ranks adjacent, then expert-parallel, then
expert-data-parallel, then pipeline::

    rank = ((pp_rank * edp + edp_rank) * e + ep_rank) * etp + etp_rank,   edp = world / (etp · e · p)

The pipeline coordinate is the attention layout's (both put p outermost), so a pipeline stage's ranks are
the same set in both views, and within a stage ``e`` may span ranks that attention uses for t, c and d: with
``--expert-tensor-parallel-size 1`` and ``t = e = 2`` the expert-parallel group *is* the tensor-parallel
group. ``etp`` defaults to t, as Megatron-Core's ``expert_tensor_parallel_size=None``.

Groups: *expert-model-parallel* (the e ranks that split one layer's experts and exchange tokens), *expert-
tensor* (etp ranks), *expert-data-parallel* (the edp ranks holding the same experts: expert gradients are
reduced over it, not over attention's dp-cp group). They come from one ``DeviceMesh`` of shape
``(p, edp, e, etp)``, whose ``"ep"`` sub-mesh also places expert weights in checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# the layout rules are pure (``ptdp plan`` checks them without torch): they live with the MoE flag checks
from ptdp.config.validate_moe import expert_layout_errors, expert_tensor_size

__all__ = ["ExpertDims", "ExpertParallel", "build_expert_parallel", "expert_layout_errors", "expert_tensor_size"]


@dataclass(frozen=True)
class ExpertDims:
    """Sizes of the expert layout over a world already split as ``t × c × d × p``."""

    world_size: int
    pp: int = 1
    ep: int = 1
    etp: int = 1

    @property
    def edp(self) -> int:
        return self.world_size // (self.etp * self.ep * self.pp)

    def coordinates(self, rank: int) -> tuple[int, int, int, int]:
        """``(pp_rank, edp_rank, ep_rank, etp_rank)`` of a global rank."""
        per_stage = self.world_size // self.pp
        local = rank % per_stage
        return rank // per_stage, local // (self.etp * self.ep), (local // self.etp) % self.ep, local % self.etp

    def rank_of(self, pp_rank: int, edp_rank: int, ep_rank: int, etp_rank: int = 0) -> int:
        return ((pp_rank * self.edp + edp_rank) * self.ep + ep_rank) * self.etp + etp_rank

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of ranks along ``axis`` (``"ep"``, ``"etp"`` or ``"edp"``), in rank order."""
        sizes = {"pp": self.pp, "edp": self.edp, "ep": self.ep, "etp": self.etp}
        others = [a for a in sizes if a != axis]
        out = []
        for fixed in _product([sizes[a] for a in others]):
            coord = dict(zip(others, fixed, strict=True))
            out.append([self.rank_of(**{f"{k}_rank": v for k, v in {**coord, axis: i}.items()})
                        for i in range(sizes[axis])])
        return out


def _product(sizes: list[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in sizes:
        out = [(*prefix, i) for prefix in out for i in range(n)]
    return out


class ExpertParallel:
    """This rank's expert groups (all None for a world of one: every collective is then a no-op).

    ``token_group`` is the group over which this rank's tokens are *replicated* between layers (attention's
    TP group without sequence parallelism): each of its ranks routes a 1/t slice so that every token goes
    to the experts exactly once.
    """

    def __init__(self, dims: ExpertDims, rank: int, device: torch.device, token_group=None,
                 sequence_group=None, sequence_scale: float = 1.0, z_loss_scale: float = 1.0):
        self.dims = dims
        self.pp_rank, self.edp_rank, self.ep_rank, self.etp_rank = dims.coordinates(rank)
        self.token_group = token_group
        # The ranks holding parts of the same sequences (SP: TP, CP: CP, both: TP x CP), for the load-
        # balancing loss (load_balancing.py); None when every rank routes whole sequences.
        self.sequence_group, self.sequence_scale, self.z_loss_scale = sequence_group, sequence_scale, z_loss_scale
        self.mesh: DeviceMesh | None = None  # checkpoints: expert weights shard on its (ep[, etp]) dimensions
        self.ep_group = self.etp_group = self.edp_group = None
        if dims.world_size > 1:
            self.mesh = init_device_mesh(device.type, (dims.pp, dims.edp, dims.ep, dims.etp),
                                         mesh_dim_names=("pp", "edp", "ep", "etp"))
            self.ep_group = self.mesh.get_group("ep")
            self.etp_group = self.mesh.get_group("etp")
            self.edp_group = self.mesh.get_group("edp")

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        """The 1-D mesh over the expert-parallel group."""
        return None if self.mesh is None else self.mesh["ep"]


def build_expert_parallel(state, ep: int, etp: int | None, sequence_parallel: bool) -> ExpertParallel:
    """The expert groups over ``state``'s ranks (a ``ParallelState``); every rank must call it.
    ``sequence_parallel`` is the derived configuration's (``ptdp.config.derive``: only with t > 1)."""
    dims = state.dims
    sequence_group = state.tp_group if sequence_parallel else state.cp_group if dims.cp > 1 else None
    if sequence_parallel and dims.cp > 1:  # the t·c ranks of one (pp, dp) coordinate
        for pp in range(dims.pp):
            for dp in range(dims.dp):
                ranks = [dims.rank_of(pp, dp, tp, cp) for cp in range(dims.cp) for tp in range(dims.tp)]
                group = dist.new_group(ranks)  # every rank takes part in creating every group
                if state.rank in ranks:
                    sequence_group = group
    etp_ = expert_tensor_size(etp, dims.tp)
    replicated = dims.tp > 1 and not sequence_parallel and etp_ == 1  # etp = t: the expert-tensor group shares the tokens
    return ExpertParallel(ExpertDims(dims.world_size, dims.pp, ep, etp_), state.rank,
                          state.device, token_group=state.tp_group if replicated else None,
                          sequence_group=sequence_group, sequence_scale=float(dims.cp),
                          z_loss_scale=1.0 / dims.tp if sequence_parallel else 1.0)
