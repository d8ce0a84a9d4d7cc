"""Process groups for PTD-P, owned by one object.

Ranks are ordered as Megatron orders them (docs/references.md, §Notation and §Context parallelism):
tensor-parallel ranks are adjacent (so a TP group sits inside one node, on NVLink), then context-parallel,
then data-parallel, then pipeline:

    rank = ((pp_rank * d + dp_rank) * c + cp_rank) * t + tp_rank

With c = 1 this is exactly ``pp_rank * (d * t) + dp_rank * t + tp_rank``. The mesh is a ``DeviceMesh`` of
shape ``(p, d, t)`` named ``("pp", "dp", "tp")`` (``(p, d, c, t)`` with ``"cp"`` when c > 1); every group
the runtime needs comes from it, plus the *embedding group* (first and last pipeline stage of the same
(dp, cp, tp) coordinates) that keeps the tied input/output embedding in sync, as Megatron does, and the
*dp-cp group* (Megatron's data-parallel-with-context group): parameters are replicated over CP as over
DP, and each CP rank's gradients are partial (its tokens only), so gradients are averaged and the
distributed optimizer shards over the d·c ranks of that group.
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
    """Sizes of the four parallel dimensions; ``dp`` is derived from the world size."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = field(init=False)

    def __post_init__(self) -> None:
        if self.world_size % (self.tp * self.cp * self.pp):
            raise ValueError(
                f"world size {self.world_size} is not divisible by tensor x context x pipeline parallel size "
                f"{self.tp}x{self.cp}x{self.pp}"
            )
        self.dp = self.world_size // (self.tp * self.cp * self.pp)

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(pp_rank, dp_rank, tp_rank)`` of a global rank (its cp rank: :meth:`cp_rank_of`)."""
        return rank // (self.dp * self.cp * self.tp), (rank // (self.cp * self.tp)) % self.dp, rank % self.tp

    def cp_rank_of(self, rank: int) -> int:
        return (rank // self.tp) % self.cp

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank


class ParallelState:
    """The process groups of one rank and the answers to rank questions.

    With a world of one process no process group is created at all, so single-process training pays
    nothing for the machinery (every collective helper treats ``group=None`` with size 1 as a no-op).
    """

    def __init__(self, dims: ParallelDims, rank: int, device: torch.device, placement: str = "loop"):
        self.dims = dims
        self.placement = placement  # of the pipeline schedule: "v" puts the first and last stage on pp rank 0
        self.rank = rank
        self.device = device
        self.pp_rank, self.dp_rank, self.tp_rank = dims.coordinates(rank)
        self.cp_rank = dims.cp_rank_of(rank)
        self.mesh: DeviceMesh | None = None
        self.tp_group = self.dp_group = self.pp_group = self.embedding_group = None
        self.cp_group = self.dp_cp_group = None  # cp_group None means c = 1
        self.expert = None  # MoE models: the folded expert groups (ptdp.parallel.expert.dims.build_expert_parallel)
        if dims.world_size > 1:
            if dims.cp > 1:
                self.mesh = init_device_mesh(device.type, (dims.pp, dims.dp, dims.cp, dims.tp),
                                             mesh_dim_names=("pp", "dp", "cp", "tp"))
                self.cp_group = self.mesh.get_group("cp")
            else:
                self.mesh = init_device_mesh(
                    device.type, (dims.pp, dims.dp, dims.tp), mesh_dim_names=("pp", "dp", "tp")
                )
            self.tp_group = self.mesh.get_group("tp")
            self.dp_group = self.mesh.get_group("dp")
            self.pp_group = self.mesh.get_group("pp")
            self.dp_cp_group = self._dp_cp_group() if dims.cp > 1 else self.dp_group
            self.embedding_group = self._embedding_group()

    def _dp_cp_group(self):
        """The d·c ranks of one (pp, tp) coordinate: gradients are averaged over them (see module doc)."""
        mine = None
        for pp_rank in range(self.dims.pp):
            for tp_rank in range(self.dims.tp):
                ranks = [self.dims.rank_of(pp_rank, dp, tp_rank, cp) for dp in range(self.dims.dp)
                         for cp in range(self.dims.cp)]
                group = dist.new_group(ranks)  # every rank takes part in creating every group
                if self.rank in ranks:
                    mine = group
        return mine

    def _embedding_group(self):
        """First and last stage of each (dp, cp, tp) column: they hold the two copies of the tied embedding.
        None when both are on one rank (p = 1, or a V placement: the trainer sums the copies locally)."""
        if self.dims.pp == 1 or self.placement == "v":
            return None
        mine = None
        for dp_rank in range(self.dims.dp):
            for cp_rank in range(self.dims.cp):
                for tp_rank in range(self.dims.tp):
                    ranks = [self.dims.rank_of(0, dp_rank, tp_rank, cp_rank),
                             self.dims.rank_of(self.dims.pp - 1, dp_rank, tp_rank, cp_rank)]
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
        return [self.dims.rank_of(s, self.dp_rank, self.tp_rank, self.cp_rank) for s in range(self.dims.pp)]


def init_distributed(timeout_minutes: float = 10.0) -> tuple[int, int, torch.device]:
    """Join the job described by torchrun's environment (or run alone), returning (rank, world, device).

    The process-group timeout makes a lost peer fail fast instead of hanging forever. When the workers
    meet in the agent's own store (``TORCHELASTIC_USE_AGENT_STORE``), it outlives a failed attempt, so
    keys go under a prefix per torchrun restart: a restarted rank must never read the address of a peer
    from the attempt before (it would connect to a dead port). Otherwise rank 0 hosts a new store on a
    new port each attempt and no prefix is needed, nor wanted: after an elastic scale-up the agents'
    restart counts differ (a joining agent starts at 0), and ranks under different prefixes never meet.
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
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            store = dist.PrefixStore(f"ptdp/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return rank, world_size, device
