"""``ptdp simulate --enable-vocab-parallel``: the vocabulary-parallel lists through time (issue 24).

The lists are the executor's own (``build_schedule(..., vocab_barriers=1|2)``, placed by
``ptdp.schedule.vocab``): the schedule's computes and p2p plus EF, S, T, EB and the collectives EMB,
BCAST_H, C0, C1, EMB_G. The model extends ``ptdp.simulate``'s:

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

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field

from ptdp.planner.vocab import vocab_pass_times
from ptdp.schedule.actions import Action, peak_stashed, stage_location
from ptdp.schedule.progress import drain
from ptdp.schedule.registry import build_schedule, schedule_placement
from ptdp.schedule.vocab import VOCAB_COLLECTIVES, VOCAB_COMPUTE, end_ranks, waits_for
from ptdp.simulate import Box, SimulationResult, _duration, _peak_in_flight, simulate, stage_scales

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

    def draw_extra(self, ax) -> list:
        """Barrier ticks on every row; the passes' legend entries (``simulate.draw``'s hook)."""
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch

        barrier_ops = ("C0", "C1")
        for op, _, done in self.collectives:
            if op in barrier_ops:
                ax.vlines(done, -0.5, self.p - 0.5, colors="black", linewidth=0.6, linestyles="dashed", alpha=0.6)
        ops = [op for op in VOCAB_COLOURS if any(b.op == op for row in self.timelines for b in row)]
        return [Patch(facecolor=VOCAB_COLOURS[op], edgecolor="black", label=VOCAB_NAMES[op]) for op in ops] + [
            Line2D([], [], color="black", linestyle="dashed", linewidth=0.6, alpha=0.6, label="barrier (C0/C1) done")]


def _fmt(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{x:.3g}" for x in values) + "]"


def simulate_vocab(schedule: str, p: int, v: int, m: int, barriers: int, pass_times: dict[str, float],
                   forward_time: float = 1.0, backward_time: float = 2.0, p2p_time: float = 0.0,
                   weight_grad_fraction: float = 0.5, stage_scale: Sequence[float] | None = None
                   ) -> VocabSimulationResult:
    """Simulate ``schedule`` with the vocabulary passes (module docstring). ``pass_times``: EF, S, T, EB on
    one rank (``vocab_pass_times``); ``stage_scale``: as ``simulate``'s, the layers only. Raises
    RuntimeError if the lists deadlock."""
    placement = schedule_placement(schedule)
    lists = [build_schedule(schedule, p, v, m, r, vocab_barriers=barriers) for r in range(p)]
    last_stage = p * v - 1
    first_chunk, last_chunk = stage_location(0, p, placement)[1], stage_location(last_stage, p, placement)[1]
    first_rank, last_rank, _ = end_ranks(p, v, placement)
    cursor = [0.0] * p
    ends: dict[tuple[str, int, int], float] = {}  # (op, microbatch, virtual stage, or rank for S/T/EF/EB)
    sends: dict[tuple[str, int, int], float] = {}  # ("F"|"B", microbatch, destination stage) -> send time
    posted: dict[tuple[int, str, int, int], float] = {}  # (rank, kind, microbatch, stage) -> RECV post time
    coll_posts: dict[tuple[str, int], list[float]] = {}
    timelines: list[list[Box]] = [[] for _ in range(p)]

    def done(op: str, mb: int) -> float | None:
        posts = coll_posts.get((op, mb), [])
        return max(posts) + p2p_time if len(posts) == p else None

    def arrival(r: int, kind: str, mb: int, stage: int, producer: tuple[str, int, int]) -> float | None:
        if stage_location(producer[2], p, placement)[0] == r:
            return ends.get(producer)
        sent = sends.get((kind, mb, stage))
        return None if sent is None else max(posted.get((r, kind, mb, stage), 0.0), sent + p2p_time)

    def ready_time(r: int, a: Action, stage: int) -> float | None:
        mb = a.microbatch
        mine = (first_chunk if r == first_rank else None, last_chunk if r == last_rank else None)
        deps: list[float | None] = [done(op, j) for op, j in waits_for(a, *mine, barriers)]
        if a.op in VOCAB_COMPUTE:
            pass  # their inputs are the collectives above
        elif a.op == "F":
            deps.append(0.0 if stage == 0 else arrival(r, "F", mb, stage, ("F", mb, stage - 1)))
        elif a.op == "W":
            deps.append(ends.get(("I", mb, stage)))
        else:
            deps.append(ends.get(("F", mb, stage)))
            if stage == last_stage and barriers == 1:
                deps.append(ends.get(("T", mb, r)))
            elif stage < last_stage:
                grads = [arrival(r, "B", mb, stage, (op, mb, stage + 1)) for op in ("B", "I")]
                grads = [g for g in grads if g is not None]
                deps.append(min(grads) if grads else None)
        return None if None in deps else max(deps, default=0.0)

    def step(r: int, a: Action, stage: int) -> bool:
        if a.op in ("SEND_F", "SEND_B"):
            kind = a.op[-1]
            sends[(kind, a.microbatch, stage + 1 if kind == "F" else stage - 1)] = cursor[r]
        elif a.op in ("RECV_F", "RECV_B"):
            posted[(r, a.op[-1], a.microbatch, stage)] = cursor[r]
        elif a.op in VOCAB_COLLECTIVES:
            coll_posts.setdefault((a.op, a.microbatch), []).append(cursor[r])
        else:
            ready = ready_time(r, a, stage)
            if ready is None:
                return False
            start = max(cursor[r], ready)
            if a.op in VOCAB_COMPUTE:
                cursor[r] = start + pass_times[a.op]
                ends[(a.op, a.microbatch, r)] = cursor[r]
            else:
                scale = 1.0 if stage_scale is None else stage_scale[stage]
                cursor[r] = start + scale * _duration(a.op, v, forward_time, backward_time, weight_grad_fraction)
                ends[(a.op, a.microbatch, stage)] = cursor[r]
            timelines[r].append(Box(r, a.op, a.microbatch, a.chunk, start, cursor[r]))
        return True

    stuck = drain(lists, p, placement, step)
    if stuck:
        raise RuntimeError(f"schedule deadlocks: ranks wait forever at {stuck}")
    collectives = sorted(((op, mb, done(op, mb)) for op, mb in coll_posts), key=lambda c: (c[2], c[0], c[1]))
    return VocabSimulationResult(
        schedule=schedule, p=p, v=v, m=m, timelines=timelines,
        total_time=max(cursor + [c[2] for c in collectives]),
        busy=[sum(b.end - b.start for b in row) for row in timelines],
        peak_in_flight=[_peak_in_flight(row) for row in timelines],
        peak_stashed=[peak_stashed(row) for row in lists],
        barriers=barriers, collectives=collectives,
    )


def simulate_from_args(args: argparse.Namespace) -> SimulationResult:
    """``ptdp simulate``'s run: the plain schedule (``simulate``), or with ``--enable-vocab-parallel`` the
    vocabulary-parallel lists, the layers per stage from ``--num-layers`` and the layout flags and the
    passes from ``--embedding-cost`` / ``--output-layer-cost``. ValueError names the flag."""
    if not args.enable_vocab_parallel:
        return simulate(args.pipeline_schedule, args.pipeline_model_parallel_size,
                        args.virtual_pipeline_model_parallel_size, args.num_microbatches, args.forward_time,
                        args.backward_time, args.p2p_time, stage_scale=stage_scales(args))
    if args.num_layers is None:
        raise ValueError("--enable-vocab-parallel needs --num-layers (the vocabulary costs are in layers)")
    p, v, m = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size, args.num_microbatches
    layers_only = argparse.Namespace(**{**vars(args), "embedding_cost": 0.0, "output_layer_cost": 0.0,
                                        "enable_vocab_parallel": False})
    per_layer = (args.forward_time * p / args.num_layers, args.backward_time * p / args.num_layers)
    barriers = 2 if args.disable_fb_fusion else 1
    times = vocab_pass_times(tuple(args.embedding_cost * x for x in per_layer),
                             tuple(args.output_layer_cost * x for x in per_layer), p, m, barriers)
    return simulate_vocab(args.pipeline_schedule, p, v, m, barriers, times, args.forward_time, args.backward_time,
                          args.p2p_time, stage_scale=stage_scales(layers_only))
