"""Pipeline schedules as data: one ``list[Action]`` per pipeline rank.

A schedule is a pure function ``(p, v, m, rank) -> list[Action]``. Keeping schedules as plain data lets one
executor (``ptdp.pipeline.executor.run_schedule``) run all of them, lets the simulator and the pictures
consume exactly what runs, and lets tests check ordering, matching and deadlock freedom without processes.

Vocabulary (Megatron-Core): ``p`` pipeline size, ``v`` model chunks per rank, ``m`` microbatches. Which
virtual stage a rank's chunk holds is the schedule's *placement* (``schedule_placement``): Megatron's loop
(chunk c of rank r is stage c·p + r) or a V for zbv, v-half and v-min (rank r holds r and 2p-1-r). The
schedules and their bubble/memory properties are in ptdp-facts.md, §Schedules, and docs/planner.md.

A schedule function lists only the computes (F, B, or the zero-bubble split I and W); ``build_schedule``
adds every SEND/RECV with ``place_communication``, which makes the lists NCCL-safe (its docstring, and
``ptdp.pipeline.nccl_model`` which checks the calls the executor makes). ``check_deadlock_free`` drains the
lists with non-blocking sends and blocking receives (FIFO per channel).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass

COMPUTE_OPS = frozenset({"F", "B", "I", "W"})
COMM_OPS = frozenset({"SEND_F", "RECV_F", "SEND_B", "RECV_B"})


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule. ``chunk`` is the LOCAL chunk index; ``peer`` only for SEND_*/RECV_*."""

    op: str  # "F" | "B" | "I" | "W" | "SEND_F" | "RECV_F" | "SEND_B" | "RECV_B"
    microbatch: int
    chunk: int
    peer: int | None = None

    def __repr__(self) -> str:  # compact, so schedules print readably
        peer = "" if self.peer is None else f"->{self.peer}" if self.op.startswith("SEND") else f"<-{self.peer}"
        return f"{self.op}{self.microbatch}.{self.chunk}{peer}"


# ---------------------------------------------------------------------------------------------- helpers


def schedule_placement(name: str) -> str:
    """How schedule ``name`` places virtual stages on ranks: ``"loop"`` (Megatron's interleaving, chunk c of
    rank r is stage c·p + r) or ``"v"`` (two chunks in a V: rank r holds stages r and 2p-1-r, so the first
    and the last stage share rank 0). The placement is part of the schedule: the model partitioning, the
    tied embedding, the communication placement and the simulator all read it from here."""
    return PLACEMENTS.get(name, "loop")


def virtual_stage(rank: int, chunk: int, p: int, placement: str = "loop") -> int:
    """The virtual stage that chunk ``chunk`` of pipeline rank ``rank`` holds (``schedule_placement``)."""
    if placement == "v":
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def stage_location(stage: int, p: int, placement: str = "loop") -> tuple[int, int]:
    """Inverse of ``virtual_stage``: ``(rank, chunk)`` holding virtual stage ``stage``."""
    if placement == "v":
        return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)
    return stage % p, stage // p


def stage_peers(rank: int, chunk: int, p: int, v: int, placement: str = "loop") -> tuple[int | None, int | None]:
    """Pipeline ranks of the previous and next virtual stage (None at either end of the pipeline)."""
    s = virtual_stage(rank, chunk, p, placement)
    prev_rank = stage_location(s - 1, p, placement)[0] if s > 0 else None
    next_rank = stage_location(s + 1, p, placement)[0] if s < p * v - 1 else None
    return prev_rank, next_rank


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


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Max number of (microbatch, chunk) pairs with F done and B/I not yet done: stashed activations."""
    live: set[tuple[int, int]] = set()
    peak = 0
    for a in actions:
        if a.op == "F":
            live.add((a.microbatch, a.chunk))
            peak = max(peak, len(live))
        elif a.op in ("B", "I"):
            live.discard((a.microbatch, a.chunk))
    return peak


def peak_stashed(actions: Sequence[Action]) -> int:
    """Max number of (microbatch, chunk) activation stashes alive at once, each kept from its F until its
    last backward action (B, or W when the backward is split: W still needs the layers' inputs). In units
    of one chunk's activations of one microbatch; 1F1B on rank 0 holds p of them (ptdp-facts.md, §Schedules)."""
    last_use = {(a.microbatch, a.chunk): i for i, a in enumerate(actions) if a.op in ("B", "I", "W")}
    live, peak = 0, 0
    for i, a in enumerate(actions):
        if a.op == "F":
            live += 1
            peak = max(peak, live)
        elif a.op in ("B", "I", "W") and last_use[a.microbatch, a.chunk] == i:
            live -= 1
    return peak


def compute_only(actions: Sequence[Action]) -> list[Action]:
    """The compute actions (F/B/I/W) of a schedule, in order: what the timing simulator needs."""
    return [a for a in actions if a.op in COMPUTE_OPS]


def _check_args(name: str, p: int, v: int, m: int, rank: int) -> None:
    if p < 1 or v < 1:
        raise ValueError(f"{name}: pipeline size p={p} and chunks v={v} must be >= 1")
    if m < 1:
        raise ValueError(
            f"{name}: need at least 1 microbatch, got m={m}; raise --global-batch-size or lower --micro-batch-size"
        )
    if not 0 <= rank < p:
        raise ValueError(f"{name}: rank {rank} outside pipeline of size {p}")


# -------------------------------------------------------------------------------------------- schedules


def gpipe(p: int, v: int, m: int, rank: int) -> list[Action]:
    """GPipe: all m forwards, then all m backwards. Stashes all m microbatches (ptdp-facts.md, §Schedules)."""
    _check_args("gpipe", p, v, m, rank)
    if v != 1:
        raise ValueError(f"gpipe: needs one model chunk per rank (v=1), got v={v}; use 'interleaved' for v > 1")
    compute = [Action("F", i, 0) for i in range(m)] + [Action("B", i, 0) for i in range(m)]
    return compute


def _one_f_one_b_compute(p: int, m: int, rank: int, backward_ops: Sequence[str]) -> list[Action]:
    warmup = min(p - rank - 1, m)
    compute = [Action("F", i, 0) for i in range(warmup)]
    for i in range(m - warmup):
        compute.append(Action("F", warmup + i, 0))
        compute += [Action(op, i, 0) for op in backward_ops]
    for i in range(m - warmup, m):
        compute += [Action(op, i, 0) for op in backward_ops]
    return compute


def one_f_one_b(p: int, v: int, m: int, rank: int) -> list[Action]:
    """1F1B (PipeDream-Flush): p-r-1 warm-up forwards, then F/B pairs, then cool-down backwards.

    At most min(p - r, m) microbatches stashed on rank r (ptdp-facts.md, §Schedules).
    """
    _check_args("1f1b", p, v, m, rank)
    if v != 1:
        raise ValueError(f"1f1b: needs one model chunk per rank (v=1), got v={v}; use 'interleaved' for v > 1")
    return _one_f_one_b_compute(p, m, rank, ["B"])


def interleaved_warmup(p: int, v: int, m: int, rank: int) -> int:
    """Megatron's warm-up forward count: (p-r-1)*2 + (v-1)*p, capped at m*v; all m*v when m == p."""
    total = m * v
    if m == p:
        return total
    return min((p - rank - 1) * 2 + (v - 1) * p, total)


def _interleaved_chunk(k: int, p: int, v: int, forward: bool) -> int:
    chunk = (k % (p * v)) // p
    return chunk if forward else v - 1 - chunk


def _interleaved_microbatch(k: int, p: int, v: int) -> int:
    return (k // (p * v)) * p + k % p


def interleaved(p: int, v: int, m: int, rank: int) -> list[Action]:
    """Megatron's interleaved 1F1B: groups of p microbatches per chunk, bubble (p-1)/(v*m).

    Virtual microbatch k runs forward on chunk (k mod p*v) div p and backward on v-1 minus that; see
    ptdp-facts.md, §Schedules for the warm-up count.
    """
    _check_args("interleaved", p, v, m, rank)
    if m % p != 0:
        raise ValueError(
            f"interleaved: the number of microbatches ({m}) must be a multiple of the pipeline size ({p}); "
            "adjust --global-batch-size / --micro-batch-size so that microbatches % pipeline size == 0"
        )
    total = m * v
    warmup = interleaved_warmup(p, v, m, rank)

    def fwd(k: int) -> Action:
        return Action("F", _interleaved_microbatch(k, p, v), _interleaved_chunk(k, p, v, True))

    def bwd(k: int) -> Action:
        return Action("B", _interleaved_microbatch(k, p, v), _interleaved_chunk(k, p, v, False))

    compute = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        compute += [fwd(warmup + k), bwd(k)]
    compute += [bwd(k) for k in range(total - warmup, total)]
    return compute


def zb_h1(p: int, v: int, m: int, rank: int) -> list[Action]:
    """Zero-bubble ZB-H1 (Qi et al. 2023): 1F1B with each B split into I (input grad) and W (weight grad).

    Only I sits on the backward critical path, so gradients travel down the pipeline faster; rank r runs
    W(i - r) right after I(i) and flushes its last r W's at the end, where 1F1B idles. With 1F1B's warm-up
    the bubble drops from (p-1)(t_f+t_b) to (p-1)(t_f+t_i-t_w), a third with t_i = t_w = t_b/2. Microbatches
    with F done and I pending stay 1F1B's (p-r); activations kept until W are at most p on every rank,
    1F1B's peak on rank 0 (ptdp-facts.md, §Schedules).
    """
    _check_args("zb-h1", p, v, m, rank)
    if v != 1:
        raise ValueError(f"zb-h1: needs one model chunk per rank (v=1), got v={v}")
    lag = min(rank, m)
    compute: list[Action] = []
    next_w = 0
    for a in _one_f_one_b_compute(p, m, rank, ["I"]):
        compute.append(a)
        if a.op == "I" and a.microbatch >= lag:
            compute.append(Action("W", next_w, 0))
            next_w += 1
    compute += [Action("W", i, 0) for i in range(next_w, m)]
    return compute


def _finished_by(done: Mapping[tuple[str, int, int], int], t: int, key: tuple[str, int, int]) -> bool:
    return key in done and done[key] <= t


def _greedy(p: int, m: int, placement: str, limit: int, interval: int = 0) -> list[list[Action]]:
    """Every rank's compute order when each rank, whenever it is free, runs the first of: a ready I
    (input gradient: on the critical path), a ready F if its activation memory allows, a pending W (weight
    gradient: fills what would be bubble), in unit time each (the papers' t_F = t_B = t_W), with free
    communication. This is the zero-bubble papers' heuristic scheduler (Qi et al., ICLR'24 §3; NeurIPS'24;
    ptdp-facts.md, §Beyond the paper: zero-bubble and V schedules).

    ``limit`` caps each rank's activation stashes (``peak_stashed`` units: one chunk of one microbatch, kept
    from F to W). An F that starts a microbatch on a rank reserves the room for every chunk the
    microbatch will still need on that rank (two in a V), so memory can never stop a microbatch half-way
    and the lists cannot deadlock; ``limit`` >= the chunks per rank is enough to make progress.
    ``interval`` > 0 lets a new microbatch enter stage 0 at most once per that many unit times.
    """
    v = 2 if placement == "v" else 1
    last = p * v - 1
    done: dict[tuple[str, int, int], int] = {}  # (op, microbatch, stage) -> end time
    reserved = [0] * p
    pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]  # (microbatch, chunk) with I done
    started: list[set[int]] = [set() for _ in range(p)]  # microbatches that hold a reservation on the rank
    orders: list[list[Action]] = [[] for _ in range(p)]
    next_f = [[0] * v for _ in range(p)]  # per (rank, chunk): the next microbatch to forward
    next_i = [[0] * v for _ in range(p)]  # and to run the input gradient of
    todo = [3 * m * v for _ in range(p)]  # an F, an I and a W per (microbatch, chunk)
    t = 0
    while any(todo):
        for r in range(p):
            if not todo[r]:
                continue
            stages = [virtual_stage(r, c, p, placement) for c in range(v)]
            ready = functools.partial(_finished_by, done, t)

            choice = None
            # 1. input gradients, latest stage first (the backward flows from the last stage down); each
            # stage's I's, like its F's, come in microbatch order, so only the next one can be ready
            for c in sorted(range(v), key=lambda c: -stages[c]):
                s, mb = stages[c], next_i[r][c]
                if mb < m and ready(("F", mb, s)) and (s == last or ready(("I", mb, s + 1))):
                    choice = Action("I", mb, c)
                    next_i[r][c] += 1
                    break
            # 2. forwards, deepest stage first; a microbatch new to this rank needs room for all its chunks
            if choice is None:
                for c in sorted(range(v), key=lambda c: -stages[c]):
                    s, mb = stages[c], next_f[r][c]
                    if mb == m or not (s == 0 or ready(("F", mb, s - 1))):
                        continue
                    if s == 0 and mb > 0 and t < done["F", mb - 1, 0] - 1 + interval:
                        continue
                    if mb not in started[r]:
                        if reserved[r] + v > limit:
                            continue
                        started[r].add(mb)
                        reserved[r] += v
                    choice = Action("F", mb, c)
                    next_f[r][c] += 1
                    break
            # 3. weight gradients, oldest first
            if choice is None and pending_w[r]:
                mb, c = pending_w[r].popleft()
                choice = Action("W", mb, c)
            if choice is None:
                continue
            orders[r].append(choice)
            todo[r] -= 1
            done[choice.op, choice.microbatch, stages[choice.chunk]] = t + 1  # visible from the next step
            if choice.op == "I":
                pending_w[r].append((choice.microbatch, choice.chunk))
            if choice.op == "W":
                reserved[r] -= 1
        t += 1
        if t > 10 * (3 * m * v + p * v):
            raise ValueError(f"greedy schedule cannot finish: p={p} m={m} placement={placement} limit={limit}")
    return orders


def _greedy_schedule(name: str, placement: str, limit: Callable[[int], int], interval: int = 0
                     ) -> Callable[[int, int, int, int], list[Action]]:
    v_needed = 2 if placement == "v" else 1

    def schedule(p: int, v: int, m: int, rank: int) -> list[Action]:
        _check_args(name, p, v, m, rank)
        if v != v_needed:
            raise ValueError(f"{name}: needs {v_needed} model chunk(s) per rank, got v={v}")
        return list(_cached_greedy(p, m, placement, limit(p), interval)[rank])

    schedule.__name__ = name
    return schedule


@functools.lru_cache(maxsize=64)
def _cached_greedy(p: int, m: int, placement: str, limit: int, interval: int) -> tuple[tuple[Action, ...], ...]:
    return tuple(tuple(order) for order in _greedy(p, m, placement, limit, interval))


# Activation limits in chunk units (``peak_stashed``): 1F1B holds p microbatches of a rank's layers on its
# first rank, which is 2p chunk units in a V (each chunk holds half of the rank's layers). The V-Half and
# V-Min building blocks of Qi et al. (NeurIPS'24) repeat every 6 and 7 unit times: a new microbatch enters
# the pipeline at most that often, which bounds how many are alive on a rank at once.
zb_h2 = _greedy_schedule("zb-h2", "loop", lambda p: 2 * p - 1)  # ZB-H2: up to 2p-1 microbatches, ~2x 1F1B
zbv = _greedy_schedule("zbv", "v", lambda p: 2 * p)  # ZB-V: 1F1B's memory, (near) zero bubble
v_half = _greedy_schedule("v-half", "v", lambda p: 2 * p, interval=6)  # V-Half: ~1/2 of 1F1B's memory
v_min = _greedy_schedule("v-min", "v", lambda p: max(2, -(-2 * p // 3) + 1), interval=7)  # V-Min: ~1/3

SCHEDULES: dict[str, Callable[[int, int, int, int], list[Action]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
    "zbv": zbv,
    "v-half": v_half,
    "v-min": v_min,
}
ZERO_BUBBLE = frozenset({"zb-h1", "zb-h2", "zbv", "v-half", "v-min"})
PLACEMENTS = {"zbv": "v", "v-half": "v", "v-min": "v"}
V_SCHEDULES = frozenset(name for name, placement in PLACEMENTS.items() if placement == "v")


def build_schedule(name: str, p: int, v: int, m: int, rank: int, forward_only: bool = False) -> list[Action]:
    """Rank ``rank``'s action list of schedule ``name`` (``SCHEDULES``): its compute order with the
    communication placed by ``place_communication`` over all ranks' lists.

    ``forward_only`` keeps the forwards (evaluation) and places communication for that list anew: a
    training list with its backwards struck out is not NCCL-safe (its batches were cut for the backwards).
    """
    return list(_cached_schedule(name, p, v, m, forward_only)[rank]) if 0 <= rank < p else _bad_rank(
        name, p, v, m, rank)


def _bad_rank(name: str, p: int, v: int, m: int, rank: int) -> list[Action]:
    _check_args(name, p, v, m, rank)
    raise AssertionError("unreachable")


@functools.lru_cache(maxsize=32)
def _cached_schedule(name: str, p: int, v: int, m: int, forward_only: bool) -> tuple[tuple[Action, ...], ...]:
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    computes = [SCHEDULES[name](p, v, m, r) for r in range(p)]
    if forward_only:
        computes = [[a for a in c if a.op == "F"] for c in computes]
    return tuple(tuple(r) for r in place_communication(computes, p, v, schedule_placement(name)))


# -------------------------------------------------------------------------------------- communication

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
    clock, pos = [0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(computes[r]):
                a = computes[r][pos[r]]
                s = virtual_stage(r, a.chunk, p, placement)
                deps = input_dependencies(a, s, last, end)
                if any(d not in end for d in deps):
                    break
                start = max([clock[r], *(end[d] for d in deps)])
                clock[r] = end[a.op, a.microbatch, s] = start + ticks[a.op]
                times[r].append((start, clock[r]))
                pos[r] += 1
                progress = True
    stuck = {r: computes[r][pos[r]] for r in range(p) if pos[r] < len(computes[r])}
    if stuck:
        raise ValueError(f"schedule cannot finish: ranks wait forever at {stuck}")
    return times


def place_communication(computes: Sequence[Sequence[Action]], p: int, v: int,
                        placement: str = "loop") -> list[list[Action]]:
    """Insert every SEND/RECV into the ranks' compute lists so that no NCCL ordering can deadlock.

    NCCL runs a rank's batched p2p calls in issue order on one stream, a batch starts only once the
    compute before it ran, and a send may wait for its receive (ptdp-facts.md, §NCCL). So each message
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
    ``ptdp.pipeline.nccl_model`` checks the calls the executor actually makes against this argument.
    """
    times = compute_times(computes, p, v, placement=placement)
    last = p * v - 1
    events: list[list[tuple[int, int, int, Action]]] = [
        [(start, 1, i, a) for i, (a, (start, _)) in enumerate(zip(computes[r], times[r]))] for r in range(p)
    ]
    for r in range(p):
        for a, (_, end) in zip(computes[r], times[r]):
            s, mb = virtual_stage(r, a.chunk, p, placement), a.microbatch
            if a.op == "F" and s < last:
                kind, dst = "F", s + 1
            elif a.op in ("B", "I") and s > 0:
                kind, dst = "B", s - 1
            else:
                continue
            q, dst_chunk = stage_location(dst, p, placement)
            if q == r:
                continue  # the next virtual stage lives on this rank: handed over locally
            order = 0 if kind == "F" else 1  # any fixed order: both ends sort by (time, kind, stage)
            events[r].append((end, 0, order * 4 * p * v + s, Action(f"SEND_{kind}", mb, a.chunk, q)))
            events[q].append((end, 0, order * 4 * p * v + s, Action(f"RECV_{kind}", mb, dst_chunk, r)))
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
    pos = [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(schedules[r]):
                a = schedules[r][pos[r]]
                s = virtual_stage(r, a.chunk, p, placement)
                if a.op.startswith("SEND"):
                    kind = a.op[-1]
                    dst_stage = s + 1 if kind == "F" else s - 1
                    assert a.peer == stage_location(dst_stage, p, placement)[0], f"rank {r}: {a} has wrong peer"
                    channels.setdefault((r, a.peer), deque()).append((kind, a.microbatch, dst_stage))
                elif a.op.startswith("RECV"):
                    q = channels.get((a.peer, r))
                    if not q:
                        break  # blocked
                    got = q.popleft()
                    assert got == (a.op[-1], a.microbatch, s), f"rank {r}: {a} matched message {got} instead"
                else:
                    if any(d not in done for d in input_dependencies(a, s, p * v - 1, done)):
                        break
                    done.add((a.op, a.microbatch, s))
                pos[r] += 1
                progress = True
    stuck = {r: schedules[r][pos[r]] for r in range(p) if pos[r] < len(schedules[r])}
    assert not stuck, f"deadlock: ranks blocked at {stuck}"
    leftover = {k: list(q) for k, q in channels.items() if q}
    assert not leftover, f"messages never received: {leftover}"

