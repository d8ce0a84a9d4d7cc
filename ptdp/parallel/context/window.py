"""Sliding windows under context parallelism: only the key chunks inside some query's window travel.

The sequence is cut into 2c chunks of n tokens, CP rank r holding chunks r and 2c-1-r
(``ptdp.parallel.context.attention``). A query chunk q sees key chunk k <= q iff its nearest pair is inside
the window, ``(q - k)·n - (n - 1) < w``: the chunks ``q - m .. q`` with ``m = (w + n - 2) // n``. Every rank
derives the same plan from (c, n, w) alone (:func:`exchange_plan`): which of its two chunks each other rank
needs. Where the causal ring sends every K/V block round all c ranks, a windowed layer sends each needed
chunk straight to the rank that needs it, and of it only the tail a window reaches (its last w - 1 tokens when
w <= n): a chunk wholly outside every window is neither sent nor computed on. With w <= n a rank receives at
most two tails (its first chunk's predecessor's, from ring-previous, and its second chunk's, from ring-next),
so the bytes a rank sends are O(w) whatever s, and the FLOPs it spends O((s/c)·w), not s²/c
(``benchmarks/window_attention.py``).

The exchange is c - 1 steps; at step t every rank posts one ``batch_isend_irecv`` holding its send to rank
r + t (if that rank needs anything of it) and its receive from rank r - t (if it needs anything of that rank),
in the same order of t on every rank; a send at step t is matched by the receive its peer posts at step t (the
plan is the same function on both sides), so every exchange completes as the ring's does (the argument in
``ptdp.parallel.context.attention._RingAttention``). The backward sends each received chunk's gradient back
the same way, reversed. Each query chunk then attends to its run of key chunks in tiles of its window
(``ptdp.models.window``), with the attention sinks in its softmax when the layer has them: exact, and O(n·w).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ptdp.models.window import local_window_attention
from ptdp.observability import communication
from ptdp.parallel.collectives import group_rank, group_size
from ptdp.parallel.context.ring import wait_all


def key_chunks(query_chunk: int, n: int, window: int) -> range:
    """The key chunks query chunk ``query_chunk`` sees through a window of ``window`` tokens."""
    return range(max(0, query_chunk - (window + n - 2) // n), query_chunk + 1)


def owner(chunk: int, c: int) -> tuple[int, int]:
    """(CP rank, slot 0 or 1) holding sequence chunk ``chunk`` of 2c."""
    return (chunk, 0) if chunk < c else (2 * c - 1 - chunk, 1)


def tail_start(query_chunk: int, chunk: int, n: int, window: int) -> int:
    """The first token of key chunk ``chunk`` (0 .. n-1) that some query of ``query_chunk`` sees: only the
    chunk's last w - 1 tokens reach past its end, so a window shorter than a chunk sends only that tail."""
    return max(0, query_chunk * n - (window - 1) - chunk * n)


@functools.lru_cache(maxsize=64)
def exchange_plan(c: int, n: int, window: int) -> tuple[tuple[tuple[tuple[int, int], ...], ...], ...]:
    """``plan[dst][src]``: the (slot, first token) of each chunk of rank ``src`` that rank ``dst`` needs, the
    tail from that token on (sorted by slot; none for src == dst)."""
    need: list[list[dict[int, int]]] = [[{} for _ in range(c)] for _ in range(c)]
    for dst in range(c):
        for query_chunk in (dst, 2 * c - 1 - dst):
            for chunk in key_chunks(query_chunk, n, window):
                src, slot = owner(chunk, c)
                if src != dst:
                    start = tail_start(query_chunk, chunk, n, window)
                    need[dst][src][slot] = min(start, need[dst][src].get(slot, n))
    return tuple(tuple(tuple(sorted(slots.items())) for slots in row) for row in need)


def received_order(c: int, n: int, window: int, rank: int) -> list[tuple[int, int, int]]:
    """The (src, slot, first token) tails rank ``rank`` receives, in the order the exchange concatenates them."""
    plan = exchange_plan(c, n, window)
    return [((rank - t) % c, slot, start) for t in range(1, c) for slot, start in plan[rank][(rank - t) % c]]


def sent_tokens(c: int, n: int, window: int, rank: int) -> int:
    """How many tokens' keys and values rank ``rank`` sends per layer (the benchmark's and the tests' count)."""
    plan = exchange_plan(c, n, window)
    return sum(n - start for t in range(1, c) for _, start in plan[(rank + t) % c][rank])


def _exchange(chunks: list[torch.Tensor], like: torch.Tensor, group, plan, rank: int, c: int,
              backward: bool) -> list[torch.Tensor]:
    """One pass of the plan. Forward (``chunks``: my two chunks): send the tails ``plan[r+t][r]`` to r + t,
    receive the tails ``plan[r][r-t]`` from r - t; returns what arrived, in :func:`received_order`. Backward
    (``chunks``: the received tails' gradients): the reverse, returning the gradients of my two chunks.
    ``like``: a chunk's shape, dtype and device."""
    b, h, n, d = like.shape
    out: list[torch.Tensor] = []
    grads = [torch.zeros_like(like) for _ in range(2)] if backward else []
    offset = 0
    for t in range(1, c):
        dst, src = (rank + t) % c, (rank - t) % c
        mine, theirs = plan[dst][rank], plan[rank][src]  # the tails I send to dst, those I receive from src
        out_peer, in_peer = (src, dst) if backward else (dst, src)
        outgoing, incoming = (theirs, mine) if backward else (mine, theirs)
        ops, buffer = [], None
        if outgoing:
            if backward:
                send = torch.cat(chunks[offset:offset + len(outgoing)], dim=2)
                offset += len(outgoing)
            else:
                send = torch.cat([chunks[slot][:, :, start:] for slot, start in outgoing], dim=2)
            ops.append(communication.send_op(send.contiguous(), dist.get_global_rank(group, out_peer), group))
        if incoming:
            buffer = like.new_empty(b, h, sum(n - start for _, start in incoming), d)
            ops.append(communication.recv_op(buffer, dist.get_global_rank(group, in_peer), group))
        if ops:
            wait_all(communication.batch_isend_irecv(ops, group, action="cp_window"))
        if buffer is not None:
            pieces = buffer.split([n - start for _, start in incoming], dim=2)
            if backward:
                for (slot, start), grad in zip(incoming, pieces):
                    grads[slot][:, :, start:] += grad
            else:
                out.extend(pieces)
    return grads if backward else out


class _WindowExchange(torch.autograd.Function):
    """``kv [b, h, 2n, d]`` (this rank's two chunks) → the tails this rank needs from the others, concatenated
    along the sequence in :func:`received_order`; the backward returns their gradients to their owners."""

    @staticmethod
    def forward(ctx, kv: torch.Tensor, group, window: int) -> torch.Tensor:
        c, r, n = group_size(group), group_rank(group), kv.shape[2] // 2
        ctx.group, ctx.window, ctx.shape = group, window, kv.shape
        chunks = list(kv.split(n, dim=2))
        received = _exchange(chunks, chunks[0], group, exchange_plan(c, n, window), r, c, backward=False)
        return torch.cat(received, dim=2) if received else kv.new_empty(*kv.shape[:2], 0, kv.shape[3])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group, window = ctx.group, ctx.window
        c, r, n = group_size(group), group_rank(group), ctx.shape[2] // 2
        sizes = [n - start for _, _, start in received_order(c, n, window, r)]
        like = grad.new_empty(*ctx.shape[:2], n, ctx.shape[3])
        grads = _exchange(list(grad.split(sizes, dim=2)), like, group, exchange_plan(c, n, window), r, c,
                          backward=True)
        return torch.cat(grads, dim=2), None, None


def windowed_context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, scale: float,
                               window: int, sinks: torch.Tensor | None = None, softcap: float | None = None,
                               bounds: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """This rank's queries ``[b, heads, 2n, d]`` (chunks r and 2c-1-r) through a sliding window over the
    whole sequence; k, v ``[b, kv_heads, 2n, ·]`` (kv_heads divides heads: they travel unrepeated).
    ``softcap``: the capped scores of ``--attn-logit-softcapping``. ``bounds``: per sample its packed
    documents' ``cu_seqlens`` over the whole sequence; each piece of a query chunk inside one document then
    attends only to that document's keys of its run (the window intersected with the document mask)."""
    c, r = group_size(group), group_rank(group)
    n, groups = q.shape[2] // 2, q.shape[1] // k.shape[1]
    sizes = [k.shape[-1], v.shape[-1]]
    kv = torch.cat([k, v], dim=-1)
    received = _WindowExchange.apply(kv, group, window)
    tails, at = {}, 0
    for src, slot, start in received_order(c, n, window, r):  # (first token, tail) of each received chunk
        tails[(src, slot)] = (start, received[:, :, at:at + n - start])
        at += n - start

    def chunk(index: int) -> tuple[int, torch.Tensor]:
        src, slot = owner(index, c)
        return (0, kv[:, :, slot * n:(slot + 1) * n]) if src == r else tails[(src, slot)]

    outs = []
    for slot, query_chunk in enumerate((r, 2 * c - 1 - r)):
        chunks = [chunk(i) for i in key_chunks(query_chunk, n, window)]  # a tail, then whole chunks
        keys, values = torch.cat([x for _, x in chunks], dim=2).split(sizes, dim=-1)
        if groups > 1:
            keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        first = key_chunks(query_chunk, n, window)[0] * n + chunks[0][0]
        queries = q[:, :, slot * n:(slot + 1) * n]
        if bounds is None:
            outs.append(local_window_attention(queries, keys, values, window, q_start=query_chunk * n,
                                               k_start=first, scale=scale, sinks=sinks, softcap=softcap))
        else:
            outs.append(inside_documents(queries, keys, values, query_chunk * n, first, window, bounds,
                                          scale=scale, sinks=sinks, softcap=softcap))
    return torch.cat(outs, dim=2)


def inside_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, k_start: int, window: int,
                     bounds: Sequence[Sequence[int]], **kwargs) -> torch.Tensor:
    """Queries at global positions ``q_start ..`` against the keys at ``k_start ..`` (reaching up to the last
    query), sample by sample and document by document: each document's queries see only its own keys,
    through the window (``ptdp.models.window.local_window_attention`` on that piece, given ``kwargs``:
    scale, sinks, softcap). ``bounds``: per sample its ``cu_seqlens``. One query chunk's attention, shared
    by the windowed exchange above and the all-gather path of ``ptdp.parallel.context.document_window``."""
    lq = q.shape[2]
    rows = []
    for i, cu in enumerate(bounds):
        parts = []
        for j in range(bisect.bisect_right(cu, q_start) - 1, len(cu) - 1):
            da, db = cu[j], cu[j + 1]
            if da >= q_start + lq:
                break
            lo, hi = max(q_start, da), min(q_start + lq, db)
            if lo >= hi:
                continue
            w = min(window, hi - da)
            ka = max(k_start, da, lo - w + 1)  # the first key any query of the piece sees
            parts.append(local_window_attention(q[i:i + 1, :, lo - q_start:hi - q_start],
                                                k[i:i + 1, :, ka - k_start:hi - k_start],
                                                v[i:i + 1, :, ka - k_start:hi - k_start], w, q_start=lo,
                                                k_start=ka, **kwargs))
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0)
