"""Every pipeline schedule, declared once: its builder, placement, constraints, help, bubble and memory.

The CLI's ``--pipeline-schedule`` choices and help (``ptdp.config``), the configuration check
(``ptdp.config.validate_pipeline``), the planner (``ptdp.planner``), the simulator (``ptdp.simulate.command``)
and the executor (``build_schedule``) all read :data:`REGISTRY`; a new schedule is one :class:`ScheduleSpec`
entry here plus its builder in ``ptdp.schedule.builders``. The schedules and their bubble/memory
properties are in docs/references.md, §Schedules, and docs/planner.md.

Pure arithmetic on plain numbers and names: a spec says what it takes (:meth:`ScheduleSpec.takes_chunks`,
:meth:`ScheduleSpec.takes_microbatches`) and refuses anything else with a ValueError in those terms; the lines
that name the flags and the fix are the configuration's (``ptdp.config.validate_pipeline.schedule_problems``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from ptdp.schedule import builders
from ptdp.schedule.actions import Action, check_args, peak_stashed, plain
from ptdp.schedule.communication import compute_times, place_communication
from ptdp.schedule.dualpipe import combined, dualpipev

Builder = Callable[[int, int, int, int], list[Action]]
# Per-chunk costs of the formulas: the zero-bubble papers' t_F = t_I = t_W (B = I + W); an overlapped pair
# F&B costs F + B of compute (the overlap hides communication, not compute).
UNIT = {"F": 1, "I": 1, "W": 1, "B": 2}


def dualpipe_bubble(p: int, v: int, m: int) -> float:
    """DualPipeV's bubble over its ideal time: (PP/2-1)(F&B+B-3W) with PP = 2p stages (DualPipe README,
    docs/references.md, §DualPipe), over a rank's 2m chunk passes of F + B; (p-1)/(3m) at unit costs."""
    f, b, w = UNIT["F"], UNIT["B"], UNIT["W"]
    return (p - 1) * ((f + b) + b - 3 * w) / (2 * m * (f + b))


@dataclass(frozen=True)
class ScheduleSpec:
    """One pipeline schedule.

    ``chunks``: model chunks per rank it runs with (1, 2 for a V, or None for any v >= 1: interleaved).
    ``placement``: ``"loop"`` (Megatron's interleaving, chunk c of rank r is stage c·p + r) or ``"v"`` (rank
    r holds stages r and 2p-1-r, so the first and the last stage share rank 0): the model partitioning, the
    tied embedding, the communication placement and the simulator read it. ``split_backward``: B is split
    into I (input gradient) and W (weight gradient), the zero-bubble family. ``bubble`` and ``memory`` are
    the help's one-line formulas; :meth:`bubble_fraction` and :meth:`stashes` compute them
    (``bubble_formula``, when given, is the schedule's own closed form). ``min_microbatches_per_p``: m must
    be at least that times p. ``combined``: the builder of the same schedule with its steady-state
    (forward, backward) pairs overlapped (``--overlap-moe-expert-parallel-comm``,
    ``ptdp.schedule.dualpipe.combined``); ``overlaps``: its own lists overlap pairs (dualpipev).
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
    min_microbatches_per_p: int = 0
    bubble_formula: Callable[[int, int, int], float] | None = None
    combined: Builder | None = None
    overlaps: bool = False  # its own lists run overlapped forward-backward pairs (dualpipev)

    def default_virtual_size(self) -> int:
        """v when the user gives none: the chunks the schedule needs (1 for interleaved)."""
        return self.chunks or 1

    def takes_chunks(self, v: int) -> bool:
        """Whether it runs with v model chunks per rank (``chunks``; any v for interleaved)."""
        return self.chunks is None or v == self.chunks

    def takes_microbatches(self, p: int, m: int) -> bool:
        """Whether it runs m microbatches on p pipeline ranks (interleaved: a multiple of p, as Megatron;
        dualpipev: at least 2p)."""
        return (not self.microbatches_multiple_of_p or m % p == 0) and m >= self.min_microbatches_per_p * p

    def runs_pairs(self, overlap: bool = False) -> bool:
        """Whether its lists run overlapped forward-backward pairs: its own (dualpipev), or with ``overlap``
        its ``combined`` variant's."""
        return self.overlaps or (overlap and self.combined is not None)

    def compute(self, p: int, v: int, m: int, rank: int, overlap: bool = False) -> list[Action]:
        """Rank ``rank``'s compute actions (no communication); ValueError naming the problem if invalid.
        ``overlap``: the ``combined`` variant (its steady-state pairs overlapped)."""
        check_args(self.name, p, v, m, rank)
        if not self.takes_chunks(v):
            raise ValueError(f"{self.name} runs {self.chunks} model chunk(s) per rank (v={self.chunks}), got v={v}")
        if not self.takes_microbatches(p, m):
            need = f"at least {self.min_microbatches_per_p}p = {self.min_microbatches_per_p * p}" \
                if self.min_microbatches_per_p else f"a multiple of p={p}"
            raise ValueError(f"{self.name} needs the number of microbatches m={m} to be {need}")
        if overlap and self.combined is None and not self.overlaps:
            raise ValueError(f"{self.name} has no overlapped (combined 1F1B) variant")
        return (self.combined if overlap and self.combined else self.builder)(p, v, m, rank)


    def bubble_fraction(self, p: int, v: int, m: int) -> float:
        """Ideal bubble time over ideal compute time (``bubble_fraction_formula``)."""
        return bubble_fraction_formula(p, v, m, self.name)

    def stashes(self, p: int, v: int, m: int, rank: int, overlap: bool = False) -> int:
        """Peak activation stashes on ``rank`` in chunk units (one chunk's activations of one microbatch,
        kept until its B, or its W when the backward is split): what the memory model charges. ``overlap``:
        of the ``combined`` lists (one more microbatch in flight)."""
        if self.split_backward or self.runs_pairs(overlap):
            return _list_peak(self, p, v, m, rank, overlap and self.combined is not None)
        if self.name == "gpipe":
            return m * v
        if self.name == "interleaved":  # Megatron's warm-up + the steady state's forward before its backward
            return m * v if m == p else min((p - rank - 1) * 2 + (v - 1) * p + 1, m * v)
        return min(p - rank, m)  # 1F1B


@functools.lru_cache(maxsize=65536)
def _list_peak(spec: ScheduleSpec, p: int, v: int, m: int, rank: int, overlap: bool) -> int:
    """``peak_stashed`` of a rank's list, built once per shape: the planner asks for each of thousands of
    layouts, and most share their (p, v, m)."""
    return peak_stashed(spec.compute(p, v, m, rank, overlap))


REGISTRY: dict[str, ScheduleSpec] = {s.name: s for s in (
    ScheduleSpec("gpipe", builders.gpipe, "all m forwards, then all m backwards", "(p-1)/m", "m microbatches"),
    ScheduleSpec("1f1b", builders.one_f_one_b, "PipeDream-Flush: warm-up forwards, then F/B pairs", "(p-1)/m", "1x",
                 combined=combined(builders.one_f_one_b)),
    ScheduleSpec("interleaved", builders.interleaved, "Megatron's interleaved 1F1B over v chunks per rank",
                 "(p-1)/(v·m)", "a bit more", chunks=None, microbatches_multiple_of_p=True,
                 combined=combined(builders.interleaved)),
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
    ScheduleSpec("dualpipev", dualpipev, "DeepSeek's DualPipeV: a V whose steady state overlaps one "
                 "microbatch's forward with another's backward, hiding the expert all-to-all (m >= 2p)",
                 "(p-1)(F&B+B-3W) = (p-1)/(3m)", "1x + 1 chunk (2p+1 chunk stashes)", chunks=2, placement="v",
                 split_backward=True, min_microbatches_per_p=2, bubble_formula=dualpipe_bubble,
                 overlaps=True),
)}

SCHEDULES: dict[str, Builder] = {name: spec.compute for name, spec in REGISTRY.items()}
ZERO_BUBBLE = frozenset(name for name, spec in REGISTRY.items() if spec.split_backward)
OVERLAPPED = frozenset(name for name, spec in REGISTRY.items() if spec.overlaps)
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


@functools.lru_cache(maxsize=1024)  # the metrics ask every logged iteration, the planner every layout
def bubble_fraction_formula(p: int, v: int, m: int, schedule: str | None = None, overlap: bool = False) -> float:
    """Ideal bubble time over ideal compute time (docs/references.md, §Schedules): (p-1)/m for GPipe and 1F1B,
    (p-1)/(v·m) interleaved; for the zero-bubble family (zb-h1, zb-h2, zbv, v-half, v-min) the bubble of the
    schedule's own lists timed with the papers' t_F = t_B = t_W and free communication (for ZB-H1 and
    m >= p that is Qi et al.'s (p-1)/(3m)); a schedule's own closed form when it has one (dualpipev).
    ``overlap``: of the combined-1F1B lists (``--overlap-moe-expert-parallel-comm``), timed the same way: a
    pair delivers both results at its end, so under 1f1b at p > 1 each pair waits for its neighbour's
    (about twice the steady state; Megatron-Core asks for a virtual pipeline there), under interleaved the
    other chunk fills the wait. ``schedule`` None means the PTD-P formula."""
    spec = REGISTRY.get(schedule) if schedule else None
    if spec is not None and spec.bubble_formula is not None:
        return spec.bubble_formula(p, v, m)
    combined = overlap and spec is not None and spec.combined is not None
    if schedule in ZERO_BUBBLE or combined:
        computes = [spec.compute(p, v, m, r, combined) for r in range(p)]
        times = compute_times(computes, p, v, UNIT, schedule_placement(schedule))
        makespan = max(end for row in times for _, end in row)
        work = 3 * m * v
        return makespan / work - 1
    return (p - 1) / (v * m)


@functools.lru_cache(maxsize=256)  # the planner asks for every layout it evaluates
def pair_share(schedule: str, p: int, v: int, m: int, overlap: bool = False) -> float:
    """The share of a rank's forward and backward passes that run inside overlapped pairs (dualpipev's, or
    combined 1F1B's with ``overlap``), averaged over the ranks: what the planner's overlap hides the expert
    communication of. 0 for a schedule without pairs."""
    spec = REGISTRY[schedule]
    if not spec.runs_pairs(overlap):
        return 0.0
    paired = total = 0
    for rank in range(p):
        for a in spec.compute(p, v, m, rank, overlap and spec.combined is not None):
            passes = [part for part in a.parts if part.op != "W"]
            total += len(passes)
            paired += len(passes) if a.sub else 0
    return paired / total


def build_schedule(name: str, p: int, v: int, m: int, rank: int, forward_only: bool = False,
                   vocab_barriers: int = 0, overlap: bool = False) -> list[Action]:
    """Rank ``rank``'s action list of schedule ``name``: its compute order with the communication placed
    by ``place_communication`` over all ranks' lists.

    ``forward_only`` keeps the forwards (evaluation) and places communication for that list anew: a
    training list with its backwards struck out is not NCCL-safe (its batches were cut for the backwards).
    ``vocab_barriers`` 1 or 2: with the vocabulary-parallel passes (``ptdp.schedule.vocab``). ``overlap``
    (``--overlap-moe-expert-parallel-comm``): the schedule's ``combined`` variant (a training list only:
    a forward-only list has no pairs to overlap).
    """
    if not 0 <= rank < p:
        check_args(name, p, v, m, rank)
    return list(_cached_schedule(name, p, v, m, forward_only, vocab_barriers, overlap and not forward_only)[rank])


@functools.lru_cache(maxsize=32)
def _cached_schedule(name: str, p: int, v: int, m: int, forward_only: bool, vocab_barriers: int = 0,
                     overlap: bool = False) -> tuple[tuple[Action, ...], ...]:
    spec = schedule_spec(name)
    computes = [spec.compute(p, v, m, r, overlap) for r in range(p)]
    if forward_only:  # an overlapped pair keeps its forward
        computes = [[a for a in plain(c) if a.op == "F"] for c in computes]
    if vocab_barriers:
        from ptdp.schedule.vocab import add_vocab_passes

        return tuple(tuple(r) for r in add_vocab_passes(computes, p, v, spec.placement, vocab_barriers, forward_only))
    return tuple(tuple(r) for r in place_communication(computes, p, v, spec.placement))
