"""``ptdp simulate --enable-vocab-parallel``: the vocabulary-parallel lists through time.

The lists are the executor's own (``build_schedule(..., vocab_barriers=1|2)``, placed by
``ptdp.schedule.vocab``): the schedule's computes and p2p plus EF, S, T, EB and the collectives EMB,
BCAST_H, C0, C1, EMB_G. The model extends ``ptdp.simulate.command``'s:

* F/B/I/W take their stage's layers only (``stage_scales`` with no vocabulary cost): the vocabulary
  layers are the passes, 1/p of them on every rank, timed by ``planner.vocab.vocab_pass_times`` from
  ``--embedding-cost`` / ``--output-layer-cost`` (in transformer layers, as ``planner.vocab.vocab_costs``
  prices them);
* a collective is posted (non-blocking) when a rank reaches it and completes ``--p2p-time`` after the last
  of the p ranks posted it; the action that consumes it (``pipeline.vocab.waits_for``: S its BCAST_H, T its
  C0, the first stage's F the EMB, with two barriers the last stage's backward its C1, EB the EMB_G) starts
  no earlier. With one barrier the last stage's backward follows its own T.

The picture draws S, T, EF and EB as boxes and each barrier as a tick where it completes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ptdp.schedule.actions import Action, stage_location
from ptdp.schedule.registry import build_schedule, schedule_placement
from ptdp.schedule.vocab import VOCAB_COLLECTIVES, end_ranks, waits_for
from ptdp.simulate.core import SimulationHooks, SimulationResult, run_lists

VOCAB_COLOURS = {"EF": "#8e44ad", "EB": "#c39bd3", "S": "#c0392b", "T": "#f1948a"}
VOCAB_NAMES = {"EF": "embedding fwd (all m)", "EB": "embedding grad", "S": "S: logits, max, sum exp",
               "T": "T: loss and logit grad"}


@dataclass
class VocabSimulationResult(SimulationResult):
    """A simulation of the vocabulary-parallel lists: the passes are boxes of ``timelines`` (so ``busy``
    counts them); ``collectives`` holds (op, microbatch, completion time) of every barrier."""

    barriers: int = 1
    collectives: list[tuple[str, int, float]] = field(default_factory=list)
    colours: dict[str, str] = field(default_factory=lambda: dict(VOCAB_COLOURS))  # ``simulate.draw`` reads it

    def pass_time(self, op: str) -> list[float]:
        """Per rank, the time spent in ``op`` (S, T, EF or EB)."""
        return [sum(b.end - b.start for b in row if b.op == op) for row in self.timelines]

    def to_dict(self) -> dict:
        return {**super().to_dict(), "vocab_barriers": self.barriers,
                "vocab_pass_time": {op: self.pass_time(op) for op in ("EF", "S", "T", "EB")},
                "collectives": [list(c) for c in self.collectives]}

    def summary_lines(self) -> list[str]:
        s, t = self.pass_time("S"), self.pass_time("T")
        return [f"vocabulary parallel, {self.barriers} barrier{'s' * (self.barriers > 1)}: S per rank "
                f"{_fmt(s)}, T per rank {_fmt(t)}, {len(self.collectives)} collectives"]

    def extra_marks(self) -> tuple[list[float], list[tuple[str, str, str]]]:
        """The barriers as dashed lines where they complete, and the passes' legend entries
        (``ptdp.simulate.draw``'s hook)."""
        ops = [op for op in VOCAB_COLOURS if any(b.op == op for row in self.timelines for b in row)]
        return ([done for op, _, done in self.collectives if op in ("C0", "C1")],
                [("box", VOCAB_COLOURS[op], VOCAB_NAMES[op]) for op in ops] + [("dashed", "black",
                                                                                 "barrier (C0/C1) done")])


def _fmt(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{x:.3g}" for x in values) + "]"


class VocabHooks(SimulationHooks):
    """The vocabulary passes (EF, S, T, EB: ``pass_times`` each, ends keyed by rank) and the collectives
    (done ``p2p_time`` after the last of the p ranks posted them) added to ``run_lists``'s loop."""

    def __init__(self, p: int, v: int, placement: str, barriers: int, pass_times: dict[str, float],
                 p2p_time: float) -> None:
        self.p, self.barriers, self.pass_times, self.p2p_time = p, barriers, pass_times, p2p_time
        self.last_stage = p * v - 1
        self.first_rank, self.last_rank, _ = end_ranks(p, v, placement)
        self.first_chunk = stage_location(0, p, placement)[1]
        self.last_chunk = stage_location(self.last_stage, p, placement)[1]
        self.coll_posts: dict[tuple[str, int], list[float]] = {}

    def done(self, op: str, mb: int) -> float | None:
        posts = self.coll_posts.get((op, mb), [])
        return max(posts) + self.p2p_time if len(posts) == self.p else None

    def inputs(self, rank: int, action: Action, stage: int, ends: dict) -> list[float | None]:
        """``waits_for``'s collectives; with one barrier the last stage's backward also follows its own T."""
        mine = (self.first_chunk if rank == self.first_rank else None,
                self.last_chunk if rank == self.last_rank else None)
        deps = [self.done(op, j) for op, j in waits_for(action, *mine, self.barriers)]
        if action.op in ("B", "I") and stage == self.last_stage and self.barriers == 1:
            deps.append(ends.get(("T", action.microbatch, rank)))
        return deps

    def duration(self, action: Action) -> float:
        return self.pass_times[action.op]

    def post(self, rank: int, action: Action, time: float) -> bool:
        if action.op not in VOCAB_COLLECTIVES:
            return False
        self.coll_posts.setdefault((action.op, action.microbatch), []).append(time)
        return True

    def collectives(self) -> list[tuple[str, int, float]]:
        return sorted(((op, mb, self.done(op, mb)) for op, mb in self.coll_posts), key=lambda c: (c[2], c[0], c[1]))

    def end_times(self) -> list[float]:
        return [c[2] for c in self.collectives()]

    def result_fields(self) -> dict:
        return {"barriers": self.barriers, "collectives": self.collectives()}


def simulate_vocab(schedule: str, p: int, v: int, m: int, barriers: int, pass_times: dict[str, float],
                   forward_time: float = 1.0, backward_time: float = 2.0, p2p_time: float = 0.0,
                   weight_grad_fraction: float = 0.5, stage_scale: Sequence[float] | None = None
                   ) -> VocabSimulationResult:
    """Simulate ``schedule`` with the vocabulary passes (module docstring). ``pass_times``: EF, S, T, EB on
    one rank (``vocab_pass_times``); ``stage_scale``: as ``simulate``'s, the layers only. Raises
    RuntimeError if the lists deadlock."""
    lists = [build_schedule(schedule, p, v, m, r, vocab_barriers=barriers) for r in range(p)]
    hooks = VocabHooks(p, v, schedule_placement(schedule), barriers, pass_times, p2p_time)
    return run_lists(schedule, lists, p, v, m, (forward_time, backward_time, p2p_time, weight_grad_fraction),
                     stage_scale, hooks, VocabSimulationResult)
