"""Communication of a schedule: the SEND/RECV placement that makes the lists NCCL-safe, and the checks.

A schedule function lists only the computes (F, B, or the zero-bubble split I and W, and overlapped
pairs of them: an "FB" action consumes and produces what its two parts do, at its end);
``place_communication`` adds every SEND/RECV, which makes the lists NCCL-safe (its docstring, and
``ptdp.simulate.nccl.model`` which checks the calls the executor makes). ``check_deadlock_free`` drains
the lists with non-blocking sends and blocking receives (FIFO per channel).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Mapping, Sequence

from ptdp.schedule.actions import Action, stage_location
from ptdp.schedule.progress import drain, part_stages

# Relative cost of each compute action in the timing that orders communication (t_b = 2 t_f, I + W = B).
TICKS = {"F": 2, "B": 4, "I": 2, "W": 2}


def input_dependencies(a: Action, s: int, last: int, done: Container[tuple[str, int, int]]
                       ) -> list[tuple[str, int, int]]:
    """The (op, microbatch, virtual stage) computes whose results action ``a`` on stage ``s`` consumes: the
    previous stage's F for an F; this stage's F and the next stage's B (or, zero-bubble, I) for a B/I;
    this stage's I for a W. ``last`` is the last virtual stage."""
    mb = a.microbatch
    if a.op == "F":
        return [("F", mb, s - 1)] if s > 0 else []
    if a.op == "W":
        return [("I", mb, s)]
    grad = ("B", mb, s + 1) if ("B", mb, s + 1) in done else ("I", mb, s + 1)
    return [("F", mb, s)] + ([grad] if s < last else [])


def compute_times(computes: Sequence[Sequence[Action]], p: int, v: int,
                  ticks: Mapping[str, float] = TICKS, placement: str = "loop") -> list[list[tuple[float, float]]]:
    """(start, end) of every compute action when each rank runs its list in order as soon as the action's
    inputs exist (``ticks`` costs, free communication). Raises ValueError if the lists cannot finish."""
    last = p * v - 1
    end: dict[tuple[str, int, int], float] = {}  # (op, microbatch, virtual stage)
    times: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    clock = [0] * p

    def step(r: int, a: Action, s: int) -> bool:
        parts = part_stages(r, a, p, placement)
        deps = [d for part, ps in parts for d in input_dependencies(part, ps, last, end)]
        if any(d not in end for d in deps):
            return False
        start = max([clock[r], *(end[d] for d in deps)])
        clock[r] = start + sum(ticks[part.op] for part, _ in parts)
        for part, ps in parts:  # an overlapped pair's results all exist at its end
            end[part.op, part.microbatch, ps] = clock[r]
        times[r].append((start, clock[r]))
        return True

    stuck = drain(computes, p, placement, step)
    if stuck:
        raise ValueError(f"schedule cannot finish: ranks wait forever at {stuck}")
    return times


def place_communication(computes: Sequence[Sequence[Action]], p: int, v: int,
                        placement: str = "loop") -> list[list[Action]]:
    """Insert every SEND/RECV into the ranks' compute lists so that no NCCL ordering can deadlock.

    NCCL runs a rank's batched p2p calls in issue order on one stream, a batch starts only once the
    compute before it ran, and a send may wait for its receive (docs/references.md, §NCCL). So each message
    gets one global time, the end of the compute that produces it in ``compute_times``, and BOTH ends post
    it at that time: the sender right after the producing compute, the receiver after its computes that
    started before that time (and before any that starts later, its consumer included). Consecutive
    SEND/RECV actions become one batched call (``executor.run_schedule``).

    Why this cannot hang: every rank posts messages in increasing time, and a batch holding the messages of
    time T depends only on computes that started before T, whose inputs are messages of times before T.
    Induction over T: the messages of the earliest unfinished time are posted on both ends (nothing they
    wait for is later), and a send meets its receive, whether sends complete on their own or wait for
    their receive. FIFO matching per channel holds because both ends order by the same time. Transfers
    overlap compute: a receive is posted when its tensor is sent and waited on only by its consumer.
    ``ptdp.simulate.nccl.model`` checks the calls the executor actually makes against this argument.
    """
    times = compute_times(computes, p, v, placement=placement)
    events: list[list[tuple[int, int, int, Action]]] = [
        [(start, 1, i, a) for i, (a, (start, _)) in enumerate(zip(computes[r], times[r]))] for r in range(p)
    ]
    for r in range(p):
        for a, (_, end) in zip(computes[r], times[r]):
            for part, s in part_stages(r, a, p, placement):
                add_p2p(events, part, r, s, end, p, v, placement)
    return [[a for *_, a in sorted(rank_events, key=lambda e: e[:3])] for rank_events in events]


# ------------------------------------------------------------------------------------------- validation


def check_deadlock_free(schedules: Sequence[Sequence[Action]], p: int, v: int, placement: str = "loop") -> None:
    """Run all ranks' lists against each other; raise AssertionError on deadlock or a mismatched message.

    Model of the executor: sends never block (isend), a receive blocks until the peer's matching send was
    issued, and messages between two ranks are matched first-in first-out (as gloo and NCCL do for one tag).
    Compute actions check their data dependencies, including local hand-offs when p == 1.
    """
    channels: dict[tuple[int, int], deque[tuple[str, int, int]]] = {}
    done: set[tuple[str, int, int]] = set()  # (op, microbatch, virtual stage) finished anywhere

    def step(r: int, a: Action, s: int) -> bool:
        if a.op.startswith("SEND"):
            kind = a.op[-1]
            dst_stage = s + 1 if kind == "F" else s - 1
            assert a.peer == stage_location(dst_stage, p, placement)[0], f"rank {r}: {a} has wrong peer"
            channels.setdefault((r, a.peer), deque()).append((kind, a.microbatch, dst_stage))
        elif a.op.startswith("RECV"):
            q = channels.get((a.peer, r))
            if not q:
                return False  # blocked
            got = q.popleft()
            assert got == (a.op[-1], a.microbatch, s), f"rank {r}: {a} matched message {got} instead"
        else:
            parts = part_stages(r, a, p, placement)
            if any(d not in done for part, ps in parts for d in input_dependencies(part, ps, p * v - 1, done)):
                return False
            done.update((part.op, part.microbatch, ps) for part, ps in parts)
        return True

    stuck = drain(schedules, p, placement, step)
    assert not stuck, f"deadlock: ranks blocked at {stuck}"
    leftover = {k: list(q) for k, q in channels.items() if q}
    assert not leftover, f"messages never received: {leftover}"


def add_p2p(events: list[list[tuple]], a: Action, r: int, s: int, end: int, p: int, v: int, placement: str) -> None:
    """Append the SEND on rank ``r`` and the RECV on its peer that compute ``a`` (virtual stage ``s``, ending
    at ``end``) makes: an activation to stage s + 1 or a gradient to s - 1. None when it sends nothing, or
    when the next virtual stage lives on this rank (handed over locally). Both ends key the pair by
    (time, 0, kind and stage), so they sort it alike."""
    if a.op == "F" and s < p * v - 1:
        kind, dst = "F", s + 1
    elif a.op in ("B", "I") and s > 0:
        kind, dst = "B", s - 1
    else:
        return
    q, dst_chunk = stage_location(dst, p, placement)
    if q == r:
        return
    order = (0 if kind == "F" else 1) * 4 * p * v + s
    events[r].append((end, 0, order, Action(f"SEND_{kind}", a.microbatch, a.chunk, q)))
    events[q].append((end, 0, order, Action(f"RECV_{kind}", a.microbatch, dst_chunk, r)))
