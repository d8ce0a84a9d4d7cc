"""Pipeline schedules as data: one ``list[Action]`` per pipeline rank (the names every caller imports).

A schedule is a pure function ``(p, v, m, rank) -> list[Action]``. The pieces live in:

* ``ptdp.schedule.actions``: ``Action``, the stage placement helpers and the stash counts;
* ``ptdp.schedule.builders``: the schedules themselves (compute actions only);
* ``ptdp.schedule.communication``: ``place_communication`` (NCCL-safe SEND/RECV placement), the timing
  it uses, and ``check_deadlock_free``;
* ``ptdp.schedule.registry``: each schedule declared once (builder, placement, constraints, help, bubble
  and memory formulas), and ``build_schedule``.

This module re-exports them so ``from ptdp.pipeline.schedules import X`` keeps working.
"""

from __future__ import annotations

from ptdp.schedule.actions import COMM_OPS, COMPUTE_OPS, Action, compute_only, peak_in_flight, peak_stashed, stage_location, stage_peers, virtual_stage
from ptdp.schedule.builders import gpipe, interleaved, interleaved_warmup, one_f_one_b, v_half, v_min, zb_h1, zb_h2, zbv
from ptdp.schedule.communication import TICKS, check_deadlock_free, compute_times, input_dependencies, place_communication
from ptdp.schedule.registry import PLACEMENTS, REGISTRY, SCHEDULES, V_SCHEDULES, ZERO_BUBBLE, ScheduleSpec, bubble_fraction_formula, build_schedule, schedule_placement, schedule_spec

__all__ = [
    "COMM_OPS", "COMPUTE_OPS", "PLACEMENTS", "REGISTRY", "SCHEDULES", "TICKS", "V_SCHEDULES", "ZERO_BUBBLE",
    "Action", "ScheduleSpec", "bubble_fraction_formula", "build_schedule", "check_deadlock_free",
    "compute_only", "compute_times", "gpipe", "input_dependencies", "interleaved", "interleaved_warmup",
    "one_f_one_b", "peak_in_flight", "peak_stashed", "place_communication", "schedule_placement",
    "schedule_spec", "stage_location", "stage_peers", "v_half", "v_min", "virtual_stage", "zb_h1", "zb_h2",
    "zbv",
]
