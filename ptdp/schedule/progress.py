"""One driver for walking per-rank action lists in dependency order.

The timing that orders communication (``communication.compute_times``), the deadlock check
(``communication.check_deadlock_free``) and the simulator (``ptdp.simulate.command``) all model the same thing:
every rank runs its list in order, and an action runs once what it waits for exists. They differ only in
what "waits for" and "runs" mean, which each passes in as ``step``. Pure: no torch, no torch.distributed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ptdp.schedule.actions import Action, virtual_stage


def part_stages(rank: int, action: Action, p: int, placement: str) -> list[tuple[Action, int]]:
    """(part, its virtual stage) of each plain action ``action`` runs (itself, or an overlapped pair's two)."""
    return [(part, virtual_stage(rank, part.chunk, p, placement)) for part in action.parts]


def drain(lists: Sequence[Sequence[Action]], p: int, placement: str,
          step: Callable[[int, Action, int], bool]) -> dict[int, Action]:
    """Run each rank's list in order, sweeping the ranks until no rank can move.

    ``step(rank, action, virtual_stage)`` runs the action and returns True, or returns False (having changed
    nothing) when the action must wait; the rank then stops until another rank's progress unblocks it. A
    composite action's stage is its first part's (``part_stages`` gives each part's).
    Returns ``{rank: action it waits at forever}``: empty when every list finished.
    """
    pos = [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(lists[r]):
                a = lists[r][pos[r]]
                if not step(r, a, virtual_stage(r, a.chunk, p, placement)):
                    break
                pos[r] += 1
                progress = True
    return {r: lists[r][pos[r]] for r in range(p) if pos[r] < len(lists[r])}
