"""Search the layouts for the fastest one that fits (``search``); the pieces live in ``space`` (the
layouts), ``estimate`` (one layout's verdict, the answer) and ``bound`` (the branch and bound)."""

from __future__ import annotations

from collections.abc import Iterable

from ptdp.planner.bound import pruned_search
from ptdp.planner.estimate import Estimate, SearchResult, evaluate, ranked_result, why_it_loses
from ptdp.planner.space import LONG_SEQUENCE, Cell, Space, candidates, cells, invalid_reason
from ptdp.planner.spec import ClusterSpec, GPTSpec, ParallelConfig, TrainingSpec

__all__ = ["LONG_SEQUENCE", "Cell", "Estimate", "SearchResult", "Space", "candidates", "cells", "evaluate",
           "invalid_reason", "ranked_result", "search", "why_it_loses"]


def search(
    model: GPTSpec,
    cluster: ClusterSpec,
    train: TrainingSpec,
    top: int = 5,
    configs: Iterable[ParallelConfig] | None = None,
    space: Space | None = None,
) -> SearchResult:
    """Fastest layout that fits, plus the best layout of each other (t, p, c, e) ranked, each with why it loses.

    Layouts that would be faster but do not fit come after the fitting ones. ``configs`` given: each of them
    priced; else the layouts of ``space`` (default: all), of which ``ptdp.planner.bound`` prices only those
    that can change the answer (the same answer).
    """
    if configs is None:
        return pruned_search(model, cluster, train, space or Space(), top)
    from ptdp.data.progress import Progress  # a bar on a terminal, a line every 10 s in a log

    configs = list(configs)
    progress = Progress("plan", len(configs), unit="layouts")
    estimates = []
    for c in configs:
        estimates.append(evaluate(model, c, cluster, train))
        progress.update(1)
    progress.close()
    ranked = sorted(estimates, key=lambda e: (not e.fits, e.iteration_time_s))
    return ranked_result(ranked, top, cluster, len(estimates))


