"""Straggler report: how far apart the ranks' step times are, and which rank is slowest.

In a synchronous job every rank waits for the slowest at the next collective, so each rank's wall time
per step is the same and tells nothing; what differs is the time each spent computing. The training loop
passes each rank's compute time in the pipeline schedule (``ScheduleStats.busy_s``: its F/B work, without
the waits for its peers), and this module gathers it once per flushed window of records (a logged,
evaluated or checkpointed iteration, when the loop reads its loss anyway): one all-gather of one float
per rank, never a collective or host sync per iteration.
"""

from __future__ import annotations

import statistics

import torch

from ptdp.observability import communication


def gather_rows(row: list[float], world_size: int, device: torch.device) -> list[list[float]]:
    """Every rank's ``row`` (the same length everywhere), indexed by global rank: ONE all-gather, which the
    memory report's per-rank numbers ride on too (``ptdp.train.report.rank_report``)."""
    if world_size == 1:
        return [list(row)]
    local = torch.tensor(row, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    communication.all_gather(gathered, local, action="rank_report")
    return torch.stack(gathered).tolist()


def step_time_fields(times: list[float]) -> dict:
    """``step_time_spread_s`` (max − min), ``step_time_max_over_median`` and ``slowest_rank`` of the
    ranks' mean compute times per step."""
    median = statistics.median(times)
    slowest = max(range(len(times)), key=times.__getitem__)
    return {"step_time_spread_s": max(times) - min(times),
            "step_time_max_over_median": times[slowest] / median if median > 0 else 1.0,
            "slowest_rank": slowest}


def mean_step_time(step_times_s: list[float]) -> float:
    return sum(step_times_s) / max(len(step_times_s), 1)


def step_time_report(step_times_s: list[float], world_size: int, device: torch.device) -> dict:
    """Collective over the default group: the mean of each rank's ``step_times_s`` (its compute time per
    step over the window), gathered, as :func:`step_time_fields`."""
    rows = gather_rows([mean_step_time(step_times_s)], world_size, device)
    return step_time_fields([r[0] for r in rows])
