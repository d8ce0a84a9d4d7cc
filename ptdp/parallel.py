"""Process groups for PTD-P, owned by one object.

Ranks are ordered as Megatron orders them (ptdp-facts.md, notation): tensor-parallel ranks are adjacent
(so a TP group sits inside one node, on NVLink), then data-parallel, then pipeline:

    rank = pp_rank * (d * t) + dp_rank * t + tp_rank

The mesh is a ``DeviceMesh`` of shape ``(p, d, t)`` named ``("pp", "dp", "tp")``; every group the
runtime needs comes from it, plus the *embedding group* (first and last pipeline stage of the same
(dp, tp) coordinates) that keeps the tied input/output embedding in sync, as Megatron does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class ParallelDims:
    """Sizes of the three parallel dimensions; ``dp`` is derived from the world size."""

    world_size: int
    tp: int = 1
    pp: int = 1
    dp: int = field(init=False)

    def __post_init__(self) -> None:
        if self.world_size % (self.tp * self.pp):
            raise ValueError(
                f"world size {self.world_size} is not divisible by tensor x pipeline parallel size "
                f"{self.tp}x{self.pp}"
            )
        self.dp = self.world_size // (self.tp * self.pp)

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(pp_rank, dp_rank, tp_rank)`` of a global rank."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank


class ParallelState:
    """The process groups of one rank and the answers to rank questions.

    With a world of one process no process group is created at all, so single-process training pays
    nothing for the machinery (every collective helper treats ``group=None`` with size 1 as a no-op).
    """

    def __init__(self, dims: ParallelDims, rank: int, device: torch.device):
        self.dims = dims
        self.rank = rank
        self.device = device
        self.pp_rank, self.dp_rank, self.tp_rank = dims.coordinates(rank)
        self.mesh: DeviceMesh | None = None
        self.tp_group = self.dp_group = self.pp_group = self.embedding_group = None
        if dims.world_size > 1:
            self.mesh = init_device_mesh(
                device.type, (dims.pp, dims.dp, dims.tp), mesh_dim_names=("pp", "dp", "tp")
            )
            self.tp_group = self.mesh.get_group("tp")
            self.dp_group = self.mesh.get_group("dp")
            self.pp_group = self.mesh.get_group("pp")
            self.embedding_group = self._embedding_group()

    def _embedding_group(self):
        """First and last stage of each (dp, tp) column: they hold the two copies of the tied embedding."""
        if self.dims.pp == 1:
            return None
        mine = None
        for dp_rank in range(self.dims.dp):
            for tp_rank in range(self.dims.tp):
                ranks = [self.dims.rank_of(0, dp_rank, tp_rank), self.dims.rank_of(self.dims.pp - 1, dp_rank, tp_rank)]
                group = dist.new_group(ranks)  # every rank takes part in creating every group
                if self.rank in ranks:
                    mine = group
        return mine

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.dims.pp - 1

    def pipeline_ranks(self) -> list[int]:
        """Global ranks of this rank's pipeline, indexed by pipeline rank."""
        return [self.dims.rank_of(s, self.dp_rank, self.tp_rank) for s in range(self.dims.pp)]


def init_distributed(timeout_minutes: float = 10.0) -> tuple[int, int, torch.device]:
    """Join the job described by torchrun's environment (or run alone), returning (rank, world, device).

    The process-group timeout makes a lost peer fail fast instead of hanging forever. Keys go under a
    prefix per torchrun restart: the launcher's store outlives a failed attempt, and a restarted rank
    must never read the address of a peer from the attempt before (it would connect to a dead port).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(minutes=timeout_minutes)
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"ptdp/attempt-{attempt}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return rank, world_size, device
