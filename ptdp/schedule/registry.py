"""Every pipeline schedule, declared once: its builder, placement, constraints, help, bubble and memory.

The CLI's ``--pipeline-schedule`` choices and help (``ptdp.config``), the configuration check
(``ptdp.config.validate_pipeline``), the planner (``ptdp.planner``), the simulator (``ptdp.simulate.command``)
and the executor (``build_schedule``) all read :data:`REGISTRY`; a new schedule is one :class:`ScheduleSpec`
entry here plus its builder in ``ptdp.schedule.builders``. The schedules and their bubble/memory
properties are in ptdp-facts.md, §Schedules, and docs/planner.md.

Pure arithmetic on plain numbers and names: a spec says what it takes (:meth:`ScheduleSpec.takes_chunks`,
:meth:`ScheduleSpec.takes_microbatches`) and refuses anything else with a ValueError in those terms; the lines
that name the flags and the fix are the configuration's (``ptdp.config.validate_pipeline.schedule_problems``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from ptdp.schedule import builders
from ptdp.schedule.actions import Action, check_args, peak_stashed
from ptdp.schedule.communication import compute_times, place_communication

Builder = Callable[[int, int, int, int], list[Action]]


@dataclass(frozen=True)
class ScheduleSpec:
    """One pipeline schedule.

    ``chunks``: model chunks per rank it runs with (1, 2 for a V, or None for any v >= 1: interleaved).
    ``placement``: ``"loop"`` (Megatron's interleaving, chunk c of rank r is stage c·p + r) or ``"v"`` (rank
    r holds stages r and 2p-1-r, so the first and the last stage share rank 0): the model partitioning, the
    tied embedding, the communication placement and the simulator read it. ``split_backward``: B is split
    into I (input gradient) and W (weight gradient), the zero-bubble family. ``bubble`` and ``memory`` are
    the help's one-line formulas; :meth:`bubble_fraction` and :meth:`stashes` compute them.
    """

    name: str
    builder: Builder
    help: str
    bubble: str
    memory: str
    chunks: int | None = 1
    placement: str = "loop"
    split_backward: bool = False
    microbatches_multiple_of_p: bool = False

    def default_virtual_size(self) -> int:
        """v when the user gives none: the chunks the schedule needs (1 for interleaved)."""
        return self.chunks or 1

    def takes_chunks(self, v: int) -> bool:
        """Whether it runs with v model chunks per rank (``chunks``; any v for interleaved)."""
        return self.chunks is None or v == self.chunks

    def takes_microbatches(self, p: int, m: int) -> bool:
        """Whether it runs m microbatches on p pipeline ranks (interleaved: a multiple of p, as Megatron)."""
        return not self.microbatches_multiple_of_p or m % p == 0

    def compute(self, p: int, v: int, m: int, rank: int) -> list[Action]:
        """Rank ``rank``'s compute actions (no communication); ValueError naming the problem if invalid."""
        check_args(self.name, p, v, m, rank)
        if not self.takes_chunks(v):
            raise ValueError(f"{self.name} runs {self.chunks} model chunk(s) per rank (v={self.chunks}), got v={v}")
        if not self.takes_microbatches(p, m):
            raise ValueError(f"{self.name} needs the number of microbatches m={m} to be a multiple of p={p}")
        return self.builder(p, v, m, rank)

    def bubble_fraction(self, p: int, v: int, m: int) -> float:
        """Ideal bubble time over ideal compute time (``bubble_fraction_formula``)."""
        return bubble_fraction_formula(p, v, m, self.name)

    def stashes(self, p: int, v: int, m: int, rank: int) -> int:
        """Peak activation stashes on ``rank`` in chunk units (one chunk's activations of one microbatch,
        kept until its B, or its W when the backward is split): what the memory model charges."""
        if self.split_backward:
            return peak_stashed(self.compute(p, v, m, rank))
        if self.name == "gpipe":
            return m * v
        if self.name == "interleaved":  # Megatron's warm-up + the steady state's forward before its backward
            return m * v if m == p else min((p - rank - 1) * 2 + (v - 1) * p + 1, m * v)
        return min(p - rank, m)  # 1F1B


REGISTRY: dict[str, ScheduleSpec] = {s.name: s for s in (
    ScheduleSpec("gpipe", builders.gpipe, "all m forwards, then all m backwards", "(p-1)/m", "m microbatches"),
    ScheduleSpec("1f1b", builders.one_f_one_b, "PipeDream-Flush: warm-up forwards, then F/B pairs", "(p-1)/m", "1x"),
    ScheduleSpec("interleaved", builders.interleaved, "Megatron's interleaved 1F1B over v chunks per rank",
                 "(p-1)/(v·m)", "a bit more", chunks=None, microbatches_multiple_of_p=True),
    ScheduleSpec("zb-h1", builders.zb_h1, "zero-bubble 1F1B, backward split into input and weight gradients",
                 "about a third of 1F1B's", "1x", split_backward=True),
    ScheduleSpec("zb-h2", builders.zb_h2, "zero-bubble, more warm-up forwards", "less when weight gradients "
                 "are cheap", "about 2x", split_backward=True),
    ScheduleSpec("zbv", builders.zbv, "zero-bubble V: two chunks per rank, v=2", "near zero", "1x", chunks=2,
                 placement="v", split_backward=True),
    ScheduleSpec("v-half", builders.v_half, "V schedule at half the memory", "between zbv and 1F1B",
                 "about 1/2", chunks=2, placement="v", split_backward=True),
    ScheduleSpec("v-min", builders.v_min, "V schedule at a third of the memory", "more than 1F1B",
                 "about 1/3", chunks=2, placement="v", split_backward=True),
)}

SCHEDULES: dict[str, Builder] = {name: spec.compute for name, spec in REGISTRY.items()}
ZERO_BUBBLE = frozenset(name for name, spec in REGISTRY.items() if spec.split_backward)
PLACEMENTS = {name: spec.placement for name, spec in REGISTRY.items() if spec.placement != "loop"}
V_SCHEDULES = frozenset(name for name, spec in REGISTRY.items() if spec.placement == "v")


def schedule_spec(name: str) -> ScheduleSpec:
    """The registered schedule ``name``; ValueError listing the choices otherwise."""
    if name not in REGISTRY:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(REGISTRY)}")
    return REGISTRY[name]


def default_schedule(name: str | None, v: int) -> str:
    """The schedule that runs: ``name``, or Megatron's default for v chunks per rank."""
    return name or ("interleaved" if v > 1 else "1f1b")


def default_virtual_size(name: str | None) -> int:
    """Chunks per rank when no v is given: 2 for the V schedules, else 1."""
    return REGISTRY[name].default_virtual_size() if name in REGISTRY else 1


def schedule_placement(name: str) -> str:
    """How schedule ``name`` places virtual stages on ranks (``ScheduleSpec.placement``); ``"loop"`` for
    lists not from the registry."""
    spec = REGISTRY.get(name)
    return spec.placement if spec else "loop"


@functools.lru_cache(maxsize=64)  # the metrics ask every logged iteration; the zero-bubble answer is a timing
def bubble_fraction_formula(p: int, v: int, m: int, schedule: str | None = None) -> float:
    """Ideal bubble time over ideal compute time (ptdp-facts.md, §Schedules): (p-1)/m for GPipe and 1F1B,
    (p-1)/(v·m) interleaved; for the zero-bubble family (zb-h1, zb-h2, zbv, v-half, v-min) the bubble of the
    schedule's own lists timed with the papers' t_F = t_B = t_W and free communication (for ZB-H1 and
    m >= p that is Qi et al.'s (p-1)/(3m)). ``schedule`` None means the PTD-P formula."""
    if schedule in ZERO_BUBBLE:
        computes = [SCHEDULES[schedule](p, v, m, r) for r in range(p)]
        times = compute_times(computes, p, v, {"F": 1, "I": 1, "W": 1, "B": 2}, schedule_placement(schedule))
        makespan = max(end for row in times for _, end in row)
        work = 3 * m * v
        return makespan / work - 1
    return (p - 1) / (v * m)


def build_schedule(name: str, p: int, v: int, m: int, rank: int, forward_only: bool = False,
                   vocab_barriers: int = 0) -> list[Action]:
    """Rank ``rank``'s action list of schedule ``name``: its compute order with the communication placed
    by ``place_communication`` over all ranks' lists.

    ``forward_only`` keeps the forwards (evaluation) and places communication for that list anew: a
    training list with its backwards struck out is not NCCL-safe (its batches were cut for the backwards).
    ``vocab_barriers`` 1 or 2: with the vocabulary-parallel passes (``ptdp.schedule.vocab``).
    """
    if not 0 <= rank < p:
        check_args(name, p, v, m, rank)
    return list(_cached_schedule(name, p, v, m, forward_only, vocab_barriers)[rank])


@functools.lru_cache(maxsize=32)
def _cached_schedule(name: str, p: int, v: int, m: int, forward_only: bool, vocab_barriers: int = 0
                     ) -> tuple[tuple[Action, ...], ...]:
    spec = schedule_spec(name)
    computes = [spec.compute(p, v, m, r) for r in range(p)]
    if forward_only:
        computes = [[a for a in c if a.op == "F"] for c in computes]
    if vocab_barriers:
        from ptdp.schedule.vocab import add_vocab_passes

        return tuple(tuple(r) for r in add_vocab_passes(computes, p, v, spec.placement, vocab_barriers, forward_only))
    return tuple(tuple(r) for r in place_communication(computes, p, v, spec.placement))
