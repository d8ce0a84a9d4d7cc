"""The simulator's core: one event loop over per-rank action lists (``run_lists``), shared by ``ptdp.simulate.command``
(the schedules) and ``ptdp.simulate.vocab`` (the vocabulary passes, added through ``SimulationHooks``).

A discrete-event model of exactly the action lists the executor runs (``ptdp.parallel.pipeline.schedules``):

* a rank executes its list in order; F takes ``forward_time / v`` (times are per whole stage, a chunk is
  1/v of it), B ``backward_time / v``, and for zero-bubble lists I and W split B (``weight_grad_fraction``);
  an overlapped pair (DualPipeV's F&B) starts once both its parts' inputs are there and takes F + B (the
  overlap hides communication, which this model does not time, not compute);
* SEND_* is non-blocking and posts at the sender's current time; RECV_* is posted (non-blocking) when the
  rank reaches it and completes at max(posting, matching send + ``p2p_time``);
* a compute action starts once the rank is free and its inputs are there: F needs the previous virtual
  stage's F (received, or local when on the same rank), B/I need this stage's F and the next stage's B/I,
  W needs its I; a hook adds inputs (collectives) and ops of its own;
* ZeRO-3's actions (``ptdp.schedule.param_sync``: the lists training runs under
  ``--data-parallel-sharding-strategy optim_grads_params``) take no time here: their cost is the planner's
  (``ptdp.planner.perf``), their ordering the NCCL model's (``ptdp.simulate.nccl.zero``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ptdp.schedule.actions import COMPUTE_OPS, Action, peak_stashed, stage_location
from ptdp.schedule.param_sync import PARAM_SYNC_OPS
from ptdp.schedule.progress import drain, part_stages
from ptdp.schedule.registry import bubble_fraction_formula, schedule_placement


@dataclass(frozen=True)
class Box:
    """One compute action placed in time; an overlapped pair ("FB") lists its parts' (op, microbatch,
    chunk) in ``parts`` (its own microbatch and chunk are its forward's)."""

    rank: int
    op: str
    microbatch: int
    chunk: int
    start: float
    end: float
    parts: tuple[tuple[str, int, int], ...] = ()


@dataclass
class SimulationResult:
    schedule: str
    p: int
    v: int
    m: int
    timelines: list[list[Box]]  # per rank, in execution order
    total_time: float
    busy: list[float]  # per rank
    peak_in_flight: list[int]  # per rank: (microbatch, chunk) pairs between F and B/I
    peak_stashed: list[int] = field(default_factory=list)  # per rank: activation stashes kept until B or W
    formula: float = field(init=False)

    def __post_init__(self) -> None:
        combined = any(b.parts for row in self.timelines for b in row)  # pairs: dualpipev's, or combined 1F1B's
        self.formula = bubble_fraction_formula(self.p, self.v, self.m, self.schedule, combined)

    @property
    def bubble_fraction(self) -> float:
        """Idle over busy time, summed over ranks: the paper's bubble fraction (p-1)/(v·m) when ideal."""
        idle = sum(self.total_time - b for b in self.busy)
        return idle / sum(self.busy)

    @property
    def idle_fraction(self) -> float:
        """Idle over total time, summed over ranks."""
        return 1.0 - sum(self.busy) / (self.p * self.total_time)

    def to_dict(self) -> dict:
        return {
            "pipeline_schedule": self.schedule,
            "pipeline_model_parallel_size": self.p,
            "virtual_pipeline_model_parallel_size": self.v,
            "num_microbatches": self.m,
            "total_time": self.total_time,
            "bubble_fraction": self.bubble_fraction,
            "bubble_fraction_formula": self.formula,
            "idle_fraction": self.idle_fraction,
            "peak_in_flight": self.peak_in_flight,
            "peak_stashed": self.peak_stashed,
            "timelines": [[[b.op, b.microbatch, b.chunk, b.start, b.end, *([list(map(list, b.parts))] if b.parts else [])]
                           for b in row] for row in self.timelines],
        }

    def summary_lines(self) -> list[str]:
        """Lines ``ptdp simulate`` prints under the common summary: none here (a richer result adds its own)."""
        return []

    def extra_marks(self) -> tuple[list[float], list[tuple[str, str, str]]]:
        """(times of dashed lines over the timeline, legend entries (kind, colour, label)) that a result adds
        to the picture (``ptdp.simulate.draw``'s hook): none here."""
        return [], []


def _duration(op: str, v: int, forward_time: float, backward_time: float, weight_grad_fraction: float) -> float:
    per_chunk_backward = backward_time / v
    return {
        "F": forward_time / v,
        "B": per_chunk_backward,
        "I": per_chunk_backward * (1 - weight_grad_fraction),
        "W": per_chunk_backward * weight_grad_fraction,
    }[op]


class SimulationHooks:
    """What a variant of the model adds to the core (``run_lists``); no-ops here. ``simulate_vocab.VocabHooks``
    adds the vocabulary passes and their collectives, so both simulators share one event loop."""

    def inputs(self, rank: int, action: Action, stage: int, ends: dict) -> list[float | None]:
        """Extra input times of ``action`` (a new list; None: not known yet); ``ends``: the loop's end times."""
        return []

    def duration(self, action: Action) -> float:
        """The time of an op outside ``COMPUTE_OPS``; its end is recorded in ``ends`` as (op, mb, rank)."""
        raise KeyError(action.op)

    def post(self, rank: int, action: Action, time: float) -> bool:
        """True when ``action`` is a (non-blocking) collective this hook posted at ``time``."""
        return False

    def end_times(self) -> list[float]:
        """When the hook's own events (collectives) complete: the total time covers them."""
        return []

    def result_fields(self) -> dict:
        """Extra fields of the result, read once the lists have drained."""
        return {}


def run_lists(name: str, lists: Sequence[Sequence[Action]], p: int, v: int, m: int,
              times: tuple[float, float, float, float], stage_scale: Sequence[float] | None,
              hooks: SimulationHooks | None = None, result: type[SimulationResult] = SimulationResult
              ) -> SimulationResult:
    """The event loop (module docstring) of ``simulate`` and ``simulate_vocab``; ``times``: forward, backward,
    p2p, weight-gradient fraction. ``hooks`` adds a variant's inputs, ops and collectives."""
    forward_time, backward_time, p2p_time, weight_grad_fraction = times
    hooks = hooks or SimulationHooks()
    placement = schedule_placement(name)
    last_stage = p * v - 1
    cursor = [0.0] * p
    ends: dict[tuple[str, int, int], float] = {}  # (op, microbatch, virtual stage, or rank for hooks' ops)
    sends: dict[tuple[str, int, int], float] = {}  # ("F"|"B", microbatch, destination stage) -> send time
    posted: dict[tuple[int, str, int, int], float] = {}  # (rank, kind, microbatch, stage) -> RECV post time
    timelines: list[list[Box]] = [[] for _ in range(p)]

    def arrival(rank: int, kind: str, mb: int, stage: int, producer: tuple[str, int, int]) -> float | None:
        """When the input of (mb, stage) from ``producer`` is usable on ``rank``; None if not yet known."""
        if stage_location(producer[2], p, placement)[0] == rank:
            return ends.get(producer)
        sent = sends.get((kind, mb, stage))
        return None if sent is None else max(posted.get((rank, kind, mb, stage), 0.0), sent + p2p_time)

    def ready_time(rank: int, a: Action, stage: int) -> float | None:
        mb = a.microbatch
        deps = hooks.inputs(rank, a, stage, ends)
        if a.op not in COMPUTE_OPS:
            pass  # a hook's op: its inputs are the hook's
        elif a.op == "F":
            deps.append(0.0 if stage == 0 else arrival(rank, "F", mb, stage, ("F", mb, stage - 1)))
        elif a.op == "W":
            deps.append(ends.get(("I", mb, stage)))
        else:
            deps.append(ends.get(("F", mb, stage)))
            if stage < last_stage:
                grads = [arrival(rank, "B", mb, stage, (op, mb, stage + 1)) for op in ("B", "I")]
                grads = [g for g in grads if g is not None]
                deps.append(min(grads) if grads else None)
        return None if None in deps else max(deps, default=0.0)

    def took(a: Action, stage: int) -> float:
        if a.op not in COMPUTE_OPS:
            return hooks.duration(a)
        scale = 1.0 if stage_scale is None else stage_scale[stage]
        return scale * _duration(a.op, v, forward_time, backward_time, weight_grad_fraction)

    def step(r: int, a: Action, stage: int) -> bool:
        if a.op in ("SEND_F", "SEND_B"):
            kind = a.op[-1]
            sends[(kind, a.microbatch, stage + 1 if kind == "F" else stage - 1)] = cursor[r]
        elif a.op in ("RECV_F", "RECV_B"):
            posted[(r, a.op[-1], a.microbatch, stage)] = cursor[r]
        elif a.op in PARAM_SYNC_OPS:
            pass
        elif not hooks.post(r, a, cursor[r]):
            parts = part_stages(r, a, p, placement)  # an overlapped pair: F&B = F + B of compute
            ready = [ready_time(r, part, s) for part, s in parts]
            if None in ready:
                return False
            start = max(cursor[r], *ready)
            cursor[r] = start + sum(took(part, s) for part, s in parts)
            for part, s in parts:
                ends[(part.op, part.microbatch, s if part.op in COMPUTE_OPS else r)] = cursor[r]
            timelines[r].append(Box(r, a.op, a.microbatch, a.chunk, start, cursor[r],
                                    tuple((part.op, part.microbatch, part.chunk) for part in a.sub)))
        return True

    stuck = drain(lists, p, placement, step)
    if stuck:
        raise RuntimeError(f"schedule deadlocks: ranks wait forever at {stuck}")
    return result(
        schedule=name, p=p, v=v, m=m, timelines=timelines,
        total_time=max(cursor + hooks.end_times()),
        busy=[sum(b.end - b.start for b in row) for row in timelines],
        peak_in_flight=[_peak_in_flight(row) for row in timelines],
        peak_stashed=[peak_stashed(row) for row in lists], **hooks.result_fields(),
    )


def _peak_in_flight(row: Sequence[Box]) -> int:
    """Most (microbatch, chunk) pairs with F finished and B/I not yet: the activations stashed over time."""
    live, peak = 0, 0
    for box in row:  # a rank runs one box at a time, so list order is time order
        for op, _, _ in box.parts or ((box.op, box.microbatch, box.chunk),):
            if op == "F":
                live += 1
                peak = max(peak, live)
            elif op in ("B", "I"):
                live -= 1
    return peak
