"""The schedules themselves: pure functions ``(p, v, m, rank) -> list[Action]`` of compute actions only.

Keeping schedules as plain data lets one executor (``ptdp.parallel.pipeline.executor.run_schedule``) run all of
them, lets the simulator and the pictures consume exactly what runs, and lets tests check ordering,
matching and deadlock freedom without processes. Each is declared once, with its placement, constraints
and formulas, in ``ptdp.schedule.registry``; ``registry.build_schedule`` adds the SEND/RECV actions
(``ptdp.schedule.communication``). The schedules and their bubble/memory properties are in
docs/references.md, §Schedules, and docs/planner.md.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from ptdp.schedule.actions import Action, overlapped, virtual_stage


def gpipe(p: int, v: int, m: int, rank: int) -> list[Action]:
    """GPipe: all m forwards, then all m backwards. Stashes all m microbatches (docs/references.md, §Schedules)."""
    compute = [Action("F", i, 0) for i in range(m)] + [Action("B", i, 0) for i in range(m)]
    return compute


def _one_f_one_b_compute(p: int, m: int, rank: int, backward_ops: Sequence[str], combined: bool = False
                         ) -> list[Action]:
    warmup = min(p - rank - 1 + combined, m)
    compute = [Action("F", i, 0) for i in range(warmup)]
    for i in range(m - warmup):
        if combined:  # the steady state's pairs overlapped (``ptdp.schedule.dualpipe``)
            compute.append(overlapped(Action("F", warmup + i, 0), Action(backward_ops[0], i, 0)))
            continue
        compute.append(Action("F", warmup + i, 0))
        compute += [Action(op, i, 0) for op in backward_ops]
    for i in range(m - warmup, m):
        compute += [Action(op, i, 0) for op in backward_ops]
    return compute


def one_f_one_b(p: int, v: int, m: int, rank: int, combined: bool = False) -> list[Action]:
    """1F1B (PipeDream-Flush): p-r-1 warm-up forwards, then F/B pairs, then cool-down backwards.

    At most min(p - r, m) microbatches stashed on rank r (docs/references.md, §Schedules). ``combined`` (combined
    1F1B, ``ptdp.schedule.dualpipe``): one more warm-up forward, and each steady-state pair overlapped.
    """
    return _one_f_one_b_compute(p, m, rank, ["B"], combined)


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


def interleaved(p: int, v: int, m: int, rank: int, combined: bool = False) -> list[Action]:
    """Megatron's interleaved 1F1B: groups of p microbatches per chunk, bubble (p-1)/(v*m).

    Virtual microbatch k runs forward on chunk (k mod p*v) div p and backward on v-1 minus that; see
    docs/references.md, §Schedules for the warm-up count. ``combined`` (combined 1F1B, ``ptdp.schedule.dualpipe``):
    one more warm-up forward, and each steady-state pair overlapped.
    """
    total = m * v
    warmup = min(interleaved_warmup(p, v, m, rank) + combined, total)

    def fwd(k: int) -> Action:
        return Action("F", _interleaved_microbatch(k, p, v), _interleaved_chunk(k, p, v, True))

    def bwd(k: int) -> Action:
        return Action("B", _interleaved_microbatch(k, p, v), _interleaved_chunk(k, p, v, False))

    compute = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        compute += [overlapped(fwd(warmup + k), bwd(k))] if combined else [fwd(warmup + k), bwd(k)]
    compute += [bwd(k) for k in range(total - warmup, total)]
    return compute


def zb_h1(p: int, v: int, m: int, rank: int) -> list[Action]:
    """Zero-bubble ZB-H1 (Qi et al. 2023): 1F1B with each B split into I (input grad) and W (weight grad).

    Only I sits on the backward critical path, so gradients travel down the pipeline faster; rank r runs
    W(i - r) right after I(i) and flushes its last r W's at the end, where 1F1B idles. With 1F1B's warm-up
    the bubble drops from (p-1)(t_f+t_b) to (p-1)(t_f+t_i-t_w), a third with t_i = t_w = t_b/2. Microbatches
    with F done and I pending stay 1F1B's (p-r); activations kept until W are at most p on every rank,
    1F1B's peak on rank 0 (docs/references.md, §Schedules).
    """
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
    docs/references.md, §Zero-bubble and V schedules).

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
    def schedule(p: int, v: int, m: int, rank: int) -> list[Action]:
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
