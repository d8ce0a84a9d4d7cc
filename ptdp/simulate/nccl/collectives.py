"""Collectives in the NCCL model (``ptdp.simulate.nccl.model``): the n-th collective a rank issues on a
communicator and group is the same call on every member, and it completes once every member has started
it (ZeRO-3's per-chunk gathers and reductions, the vocabulary-parallel barriers, expert dispatch)."""

from __future__ import annotations

from collections.abc import Sequence


def match_collectives(ranks: Sequence, problems: list[str]) -> dict:
    """(rank, issue, op) of each collective -> [(rank, issue)] of every member's matching one (the n-th on
    the same communicator and group)."""
    seqs: dict[tuple[str, tuple[int, ...], int], list[tuple[int, int, int, list]]] = {}
    for r, rk in enumerate(ranks):
        for i, ops in enumerate(rk.issues):
            for k, op in enumerate(ops):
                if op["op"] == "coll":
                    group = tuple(op.get("group", range(len(ranks))))  # default: every rank of the trace
                    seqs.setdefault((rk.comms[i], group, r), []).append((r, i, k, op["msg"]))
    out = {}
    for (comm, group, r), mine in seqs.items():
        for n, (_, i, k, msg) in enumerate(mine):
            partners = []
            for q in group:
                theirs = seqs.get((comm, group, q), [])
                if n >= len(theirs):
                    problems.append(f"unmatched: rank {r}'s collective {msg} #{n} on {comm}: rank {q} makes "
                                    f"only {len(theirs)}")
                    continue
                if list(theirs[n][3]) != list(msg):
                    problems.append(f"mismatch: rank {r}'s collective #{n} on {comm} is {msg}, rank {q}'s "
                                    f"is {theirs[n][3]}")
                partners.append((q, theirs[n][1]))
            out[(r, i, k)] = partners
    return out
