"""Vocabulary parallelism across pipeline stages (Yeung et al. 2024): the schedule side.

The input embedding and the output layer with its cross-entropy are split by vocabulary over all p
pipeline ranks (docs/references.md, §Vocabulary parallelism). Their work becomes actions in every rank's list,
so the one executor (``ptdp.parallel.pipeline.executor``) runs any schedule with them:

* ``EF`` (once per iteration, first): this rank's rows of the embedding for every microbatch's ids; the
  collective ``EMB`` sums the partial embeddings onto the first stage, whose F of each microbatch reads it.
* ``BCAST_H`` (per microbatch): the last stage's final hidden state to every pipeline rank.
* ``S``: this rank's slice of the logits, its max and sum of exponentials (one barrier: also this slice's
  share of the input gradient); ``C0`` joins the statistics over the pipeline group (an all-gather).
* ``T``: the loss and the logit gradient: the weight-slice gradient, and (two barriers) the partial input
  gradient, which ``C1`` sums onto the last stage; with one barrier the last stage assembles it from C0.
  Either way the last stage's backward of its last chunk consumes it.
* ``EMB_G`` and ``EB`` (once, last): the first stage's embedding-output gradients to every rank, which adds
  them into its rows.

With multi-token prediction the last stage embeds tokens too: its F waits for EMB, which then
reaches every rank (an all-reduce), and EMB_G sums both ends' gradients; S and T carry the MTP modules'
heads beside the model's (``ptdp.parallel.vocab``). The actions and their order do not change.

Placement (:func:`add_vocab_passes`): a list scheduler over the schedule's own compute order (an overlapped
pair, DualPipeV's, runs once both its parts' inputs exist), in the cost
units of ``communication.TICKS``. A free rank runs a ready T, else a ready S, else its next action; the rank
holding the last stage may run up to ``LOOKAHEAD`` later forwards while its backward waits for the
barrier (the paper's extra in-flight microbatches: p+2 with one barrier, p+1 with two). So the barriers
overlap transformer work. Every message and collective then gets one global time, the end of what
produces it, and every rank posts them in that order (``place_communication``'s argument, with a
collective completing once all p ranks posted it); ``ptdp.simulate.nccl.model`` checks the result.
"""

from __future__ import annotations

from collections.abc import Sequence

from ptdp.schedule.actions import Action, stage_location, virtual_stage
from ptdp.schedule.communication import TICKS, add_p2p

VOCAB_COMPUTE = frozenset({"EF", "S", "T", "EB"})
VOCAB_COLLECTIVES = frozenset({"EMB", "BCAST_H", "C0", "C1", "EMB_G"})
VOCAB_TICKS = {"S": 1, "T": 1}  # 1/p of the output layer each; in TICKS units (F = 2)
LOOKAHEAD = 2  # forwards the last stage may run ahead while its backward waits for the vocabulary barrier
_LATE = 1 << 40  # the time of the end-of-iteration embedding gradient exchange


def waits_for(action: Action, first_chunk: int | None, last_chunk: int | None, barriers: int,
              embeds_last: bool = False) -> list[tuple[str, int]]:
    """The collectives (op, microbatch) a compute action consumes: the executor's stage waits for them.
    ``embeds_last``: the last stage reads EMB too (multi-token prediction embeds tokens there)."""
    op, mb = action.op, action.microbatch
    if op == "S":
        return [("BCAST_H", mb)]
    if op == "T":
        return [("C0", mb)]
    if op == "EB":
        return [("EMB_G", 0)]
    if op == "F" and (action.chunk == first_chunk or (embeds_last and action.chunk == last_chunk)):
        return [("EMB", 0)]
    if op in ("B", "I") and action.chunk == last_chunk and barriers == 2:
        return [("C1", mb)]
    return []


def end_ranks(p: int, v: int, placement: str) -> tuple[int, int, int]:
    """(rank of the first stage, rank of the last stage, the last virtual stage)."""
    last = p * v - 1
    return stage_location(0, p, placement)[0], stage_location(last, p, placement)[0], last


def add_vocab_passes(computes: Sequence[Sequence[Action]], p: int, v: int, placement: str, barriers: int,
                     forward_only: bool = False) -> list[list[Action]]:
    """Every rank's full list: the schedule's computes with the vocabulary passes and all communication
    (point-to-point and collectives) placed (module docstring). ``barriers``: 1 (fused) or 2."""
    orders, times = _list_schedule(computes, p, v, placement, barriers, forward_only)
    return _place(orders, times, p, v, placement, barriers, forward_only)


def _list_schedule(computes, p, v, placement, barriers, forward_only):
    first_rank, last_rank, last = end_ranks(p, v, placement)
    m = 1 + max(a.microbatch for c in computes for a in c)
    end: dict[tuple, float] = {}  # (op, microbatch, stage or rank) -> end time
    ticks = {**TICKS, **VOCAB_TICKS}
    base_done = [set() for _ in range(p)]
    pos, clock = [0] * p, [0] * p
    orders: list[list[Action]] = [[] for _ in range(p)]
    times: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    next_s, next_t = [0] * p, [0] * p
    ahead = [0] * p  # forwards run ahead of a waiting backward, not yet passed in the list

    def barrier(op: str, mb: int) -> float | None:
        ends = [end.get((op, mb, r)) for r in range(p)]
        return None if None in ends else max(ends)

    def ready_at(r: int, a: Action) -> float | None:
        if a.sub:  # an overlapped pair: when both parts' inputs exist
            parts = [ready_at(r, part) for part in a.sub]
            return None if None in parts else max(parts)
        s, mb = virtual_stage(r, a.chunk, p, placement), a.microbatch
        if a.op == "S":
            return end.get(("F", mb, last))
        if a.op == "T":
            return barrier("S", mb)
        deps = []
        if a.op == "F":
            deps = [end.get(("F", mb, s - 1))] if s > 0 else []
        elif a.op == "W":
            deps = [end.get(("I", mb, s))]
        else:
            deps = [end.get(("F", mb, s))]
            if s < last:
                deps.append(end.get(("B", mb, s + 1), end.get(("I", mb, s + 1))))
            elif barriers == 2:
                deps.append(barrier("T", mb))
            else:
                deps.append(end.get(("T", mb, r)))
        return None if None in deps else max(deps, default=0)

    def run(r: int, a: Action, start: float) -> None:
        clock[r] = start + sum(ticks[part.op] for part in a.parts)
        for part in a.parts:  # an overlapped pair's results all exist at its end
            key_place = r if part.op in ("S", "T") else virtual_stage(r, part.chunk, p, placement)
            end[part.op, part.microbatch, key_place] = clock[r]
        orders[r].append(a)
        times[r].append((start, clock[r]))

    remaining = sum(len(c) for c in computes) + 2 * p * m  # and an S and a T per microbatch per rank
    t, limit = 0, 20 * (remaining + p) * max(ticks.values())
    while remaining:
        for r in range(p):
            if clock[r] > t:
                continue
            candidates: list[tuple[Action, int | None]] = []
            if next_t[r] < m:
                candidates.append((Action("T", next_t[r], 0), None))
            if next_s[r] < m:
                candidates.append((Action("S", next_s[r], 0), None))
            while pos[r] < len(computes[r]) and pos[r] in base_done[r]:
                pos[r] += 1
                ahead[r] = max(0, ahead[r] - 1)
            if pos[r] < len(computes[r]):
                candidates.append((computes[r][pos[r]], pos[r]))
                nxt = computes[r][pos[r]]
                waiting_on_vocab = r == last_rank and any(
                    part.op in ("B", "I") and virtual_stage(r, part.chunk, p, placement) == last for part in nxt.parts)
                if waiting_on_vocab and ahead[r] < LOOKAHEAD:  # a later plain F, not past an overlapped pair
                    later = range(pos[r] + 1, next((k for k in range(pos[r] + 1, len(computes[r]))
                                                    if computes[r][k].sub), len(computes[r])))
                    k = next((k for k in later if k not in base_done[r] and computes[r][k].op == "F"), None)
                    if k is not None:
                        candidates.append((computes[r][k], k))
            for a, k in candidates:
                when = ready_at(r, a)
                if when is None or when > t:
                    continue
                run(r, a, t)
                remaining -= 1
                if a.op == "S":
                    next_s[r] += 1
                elif a.op == "T":
                    next_t[r] += 1
                else:
                    base_done[r].add(k)
                    if k != pos[r]:
                        ahead[r] += 1
                break
        t += 1
        if t > limit:
            raise ValueError(f"vocabulary passes cannot be placed: p={p} v={v} placement={placement}")
    return orders, times


def _place(orders, times, p, v, placement, barriers, forward_only) -> list[list[Action]]:
    """Events sorted by (time, communication before compute, a key both ends share)."""
    first_rank, last_rank, last = end_ranks(p, v, placement)
    m = 1 + max(a.microbatch for o in orders for a in o)
    events: list[list[tuple]] = [[(start, 1, i, a) for i, (a, (start, _)) in enumerate(zip(orders[r], times[r]))]
                                 for r in range(p)]
    f_last, s_end, t_end = {}, {}, {}
    for r in range(p):
        for a, (_, end) in zip(orders[r], times[r]):
            for part in a.parts:
                s, mb = virtual_stage(r, part.chunk, p, placement), part.microbatch
                if part.op == "S":
                    s_end[mb] = max(s_end.get(mb, 0), end)
                    continue
                if part.op == "T":
                    t_end[mb] = max(t_end.get(mb, 0), end)
                    continue
                if part.op == "F" and s == last:
                    f_last[mb] = end
                add_p2p(events, part, r, s, end, p, v, placement)
    base = 8 * p * v
    for r in range(p):
        coll = [(-2, 1, 0, Action("EF", 0, 0)), (-1, 0, base, Action("EMB", 0, 0))]
        for mb in range(m):
            coll.append((f_last[mb], 0, base + 4 * mb + 1, Action("BCAST_H", mb, 0)))
            coll.append((s_end[mb], 0, base + 4 * mb + 2, Action("C0", mb, 0)))
            if barriers == 2 and not forward_only:
                coll.append((t_end[mb], 0, base + 4 * mb + 3, Action("C1", mb, 0)))
        if not forward_only:
            coll += [(_LATE, 0, base, Action("EMB_G", 0, 0)), (_LATE, 1, 0, Action("EB", 0, 0))]
        events[r] += coll
    return [[a for *_, a in sorted(rank_events, key=lambda e: e[:3])] for rank_events in events]
