"""The vocabulary of pipeline schedules: one ``Action`` per step of a rank's list, and where stages live.

Vocabulary (Megatron-Core): ``p`` pipeline size, ``v`` model chunks per rank, ``m`` microbatches. Which
virtual stage a rank's chunk holds is the schedule's *placement* (``ptdp.schedule.registry``): Megatron's
loop (chunk c of rank r is stage c·p + r) or a V (rank r holds r and 2p-1-r). These helpers are shared by
the builders, the communication placement, the executor, the simulator and the planner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

COMPUTE_OPS = frozenset({"F", "B", "I", "W"})
COMM_OPS = frozenset({"SEND_F", "RECV_F", "SEND_B", "RECV_B"})
OVERLAP = "FB"  # the forward of one microbatch and the backward (B or I) of another, run as one overlapped pair


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule. ``chunk`` is the LOCAL chunk index; ``peer`` only for SEND_*/RECV_*.

    A composite action (``OVERLAP``, "FB": DualPipe's overlapped forward-and-backward pair, Megatron-Core's
    combined 1F1B step) runs its ``sub`` actions together; its own ``microbatch`` and ``chunk`` are its
    forward's. Whatever orders, places or times computes reads :attr:`parts`.
    """

    op: str  # "F" | "B" | "I" | "W" | "FB" | "SEND_F" | "RECV_F" | "SEND_B" | "RECV_B" | a plug-in's op
    microbatch: int
    chunk: int
    peer: int | None = None
    sub: tuple[Action, ...] = ()

    @property
    def parts(self) -> tuple[Action, ...]:
        """The plain actions this one runs: its ``sub`` actions, or itself."""
        return self.sub or (self,)

    def __repr__(self) -> str:  # compact, so schedules print readably
        if self.sub:
            return f"{self.op}[{'+'.join(map(repr, self.sub))}]"
        peer = "" if self.peer is None else f"->{self.peer}" if self.op.startswith("SEND") else f"<-{self.peer}"
        return f"{self.op}{self.microbatch}.{self.chunk}{peer}"


def overlapped(forward: Action, backward: Action) -> Action:
    """The ``OVERLAP`` action running ``forward`` (an F) and ``backward`` (a B or I of another microbatch)
    as one interleaved pair."""
    if forward.op != "F" or backward.op not in ("B", "I"):
        raise ValueError(f"an overlapped pair is a forward and a backward, got {forward} and {backward}")
    return Action(OVERLAP, forward.microbatch, forward.chunk, sub=(forward, backward))


def plain(actions: Sequence[Action]) -> list[Action]:
    """``actions`` with every composite action replaced by its parts, in order."""
    return [part for a in actions for part in a.parts]


def virtual_stage(rank: int, chunk: int, p: int, placement: str = "loop") -> int:
    """The virtual stage that chunk ``chunk`` of pipeline rank ``rank`` holds (``schedule_placement``)."""
    if placement == "v":
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def stage_location(stage: int, p: int, placement: str = "loop") -> tuple[int, int]:
    """Inverse of ``virtual_stage``: ``(rank, chunk)`` holding virtual stage ``stage``."""
    if placement == "v":
        return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)
    return stage % p, stage // p


def stage_peers(rank: int, chunk: int, p: int, v: int, placement: str = "loop") -> tuple[int | None, int | None]:
    """Pipeline ranks of the previous and next virtual stage (None at either end of the pipeline)."""
    s = virtual_stage(rank, chunk, p, placement)
    prev_rank = stage_location(s - 1, p, placement)[0] if s > 0 else None
    next_rank = stage_location(s + 1, p, placement)[0] if s < p * v - 1 else None
    return prev_rank, next_rank


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Max number of (microbatch, chunk) pairs with F done and B/I not yet done: stashed activations."""
    live: set[tuple[int, int]] = set()
    peak = 0
    for a in plain(actions):
        if a.op == "F":
            live.add((a.microbatch, a.chunk))
            peak = max(peak, len(live))
        elif a.op in ("B", "I"):
            live.discard((a.microbatch, a.chunk))
    return peak


def peak_stashed(actions: Sequence[Action]) -> int:
    """Max number of (microbatch, chunk) activation stashes alive at once, each kept from its F until its
    last backward action (B, or W when the backward is split: W still needs the layers' inputs). In units
    of one chunk's activations of one microbatch; 1F1B on rank 0 holds p of them (docs/references.md, §Schedules)."""
    actions = plain(actions)
    last_use = {(a.microbatch, a.chunk): i for i, a in enumerate(actions) if a.op in ("B", "I", "W")}
    live, peak = 0, 0
    for i, a in enumerate(actions):
        if a.op == "F":
            live += 1
            peak = max(peak, live)
        elif a.op in ("B", "I", "W") and last_use[a.microbatch, a.chunk] == i:
            live -= 1
    return peak


def compute_only(actions: Sequence[Action]) -> list[Action]:
    """The compute actions (F/B/I/W, and the overlapped pairs of them) of a schedule, in order: what the
    timing simulator needs."""
    return [a for a in actions if a.op in COMPUTE_OPS or a.op == OVERLAP]


def check_args(name: str, p: int, v: int, m: int, rank: int) -> None:
    if p < 1 or v < 1:
        raise ValueError(f"{name}: pipeline size p={p} and chunks v={v} must be >= 1")
    if m < 1:
        raise ValueError(f"{name}: need at least 1 microbatch, got m={m}")
    if not 0 <= rank < p:
        raise ValueError(f"{name}: rank {rank} outside pipeline of size {p}")
