"""Sliding windows under context parallelism: only the key chunks inside some query's window travel.

The sequence is cut into 2c chunks of n tokens, CP rank r holding chunks r and 2c-1-r
(``ptdp.parallel.context.attention``). A query chunk q sees key chunk k <= q iff its nearest pair is inside
the window, ``(q - k)·n - (n - 1) < w``: the chunks ``q - m .. q`` with ``m = (w + n - 2) // n``. Every rank
derives the same plan from (c, n, w) alone (:func:`exchange_plan`): which of its two chunks each other rank
needs. Where the causal ring sends every K/V block round all c ranks, a windowed layer sends each needed
chunk straight to the rank that needs it and nothing else: a chunk wholly outside every window is neither
sent nor computed on. With w <= n a rank receives at most two chunks (its first chunk's predecessor, from
ring-previous, and its second chunk's, from ring-next), so the bytes a rank sends and the FLOPs it spends
grow with (s/c)·w, not s²/c (``benchmarks/window_attention.py``).

The exchange is c - 1 steps; at step t every rank posts one ``batch_isend_irecv`` holding its send to rank
r + t (if that rank needs anything of it) and its receive from rank r - t (if it needs anything of that rank),
in the same order of t on every rank; a send at step t is matched by the receive its peer posts at step t (the
plan is the same function on both sides), so every exchange completes as the ring's does (the argument in
``ptdp.parallel.context.attention._RingAttention``). The backward sends each received chunk's gradient back
the same way, reversed. Each query chunk then attends to its run of key chunks in tiles of its window
(``ptdp.models.window``), with the attention sinks in its softmax when the layer has them: exact, and O(n·w).
"""

from __future__ import annotations

import functools

import torch

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


@functools.lru_cache(maxsize=64)
def exchange_plan(c: int, n: int, window: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """``plan[dst][src]``: the slots of rank ``src`` that rank ``dst`` needs (sorted; none for src == dst)."""
    need = [[set() for _ in range(c)] for _ in range(c)]
    for dst in range(c):
        for query_chunk in (dst, 2 * c - 1 - dst):
            for chunk in key_chunks(query_chunk, n, window):
                src, slot = owner(chunk, c)
                if src != dst:
                    need[dst][src].add(slot)
    return tuple(tuple(tuple(sorted(slots)) for slots in row) for row in need)


def received_order(c: int, n: int, window: int, rank: int) -> list[tuple[int, int]]:
    """The (src, slot) chunks rank ``rank`` receives, in the order the exchange stacks them."""
    plan = exchange_plan(c, n, window)
    return [((rank - t) % c, slot) for t in range(1, c) for slot in plan[rank][(rank - t) % c]]


def sent_chunks(c: int, n: int, window: int, rank: int) -> int:
    """How many chunks of n tokens rank ``rank`` sends per layer (for the benchmark)."""
    plan = exchange_plan(c, n, window)
    return sum(len(plan[(rank + t) % c][rank]) for t in range(1, c))


def _exchange(chunks: list[torch.Tensor], like: torch.Tensor, group, plan, rank: int, c: int,
              backward: bool) -> list[torch.Tensor]:
    """One pass of the plan. Forward: send my slots ``plan[r+t][r]`` (``chunks`` = my two chunks) to r + t,
    receive ``plan[r][r-t]`` from r - t; returns what arrived, in :func:`received_order`. Backward: the
    reverse (``chunks`` = the received chunks' gradients): send them back to r - t, receive from r + t the
    gradients of my slots it used; returns them per slot. ``like``: a chunk's shape, dtype and device."""
    b, h, n, d = like.shape
    out: list[torch.Tensor] = []
    grads = [torch.zeros_like(like) for _ in range(2)] if backward else []
    offset = 0
    for t in range(1, c):
        dst, src = (rank + t) % c, (rank - t) % c
        mine, theirs = plan[dst][rank], plan[rank][src]  # I send `mine` to dst; I receive `theirs` from src
        ops, buffer = [], None
        if backward:
            if theirs:
                back = torch.cat(chunks[offset:offset + len(theirs)], dim=2).contiguous()
                offset += len(theirs)
                ops.append(communication.send_op(back, torch.distributed.get_global_rank(group, src), group))
            if mine:
                buffer = like.new_empty(b, h, n * len(mine), d)
                ops.append(communication.recv_op(buffer, torch.distributed.get_global_rank(group, dst), group))
        else:
            if mine:
                send = torch.cat([chunks[s] for s in mine], dim=2).contiguous()
                ops.append(communication.send_op(send, torch.distributed.get_global_rank(group, dst), group))
            if theirs:
                buffer = like.new_empty(b, h, n * len(theirs), d)
                ops.append(communication.recv_op(buffer, torch.distributed.get_global_rank(group, src), group))
        if ops:
            wait_all(communication.batch_isend_irecv(ops, group, action="cp_window"))
        if buffer is not None:
            if backward:
                for slot, grad in zip(mine, buffer.split(n, dim=2)):
                    grads[slot] += grad
            else:
                out.extend(buffer.split(n, dim=2))
    return grads if backward else out


class _WindowExchange(torch.autograd.Function):
    """``kv [b, h, 2n, d]`` (this rank's two chunks) → ``[R, b, h, n, d]``: the R chunks this rank needs
    from the others (:func:`received_order`); the backward returns their gradients to their owners."""

    @staticmethod
    def forward(ctx, kv: torch.Tensor, group, window: int) -> torch.Tensor:
        c, r, n = group_size(group), group_rank(group), kv.shape[2] // 2
        ctx.group, ctx.window, ctx.shape = group, window, kv.shape
        chunks = list(kv.split(n, dim=2))
        received = _exchange(chunks, chunks[0], group, exchange_plan(c, n, window), r, c, backward=False)
        if not received:
            return kv.new_empty(0, *chunks[0].shape)
        return torch.stack(received)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group, window = ctx.group, ctx.window
        c, r, n = group_size(group), group_rank(group), ctx.shape[2] // 2
        like = grad.new_empty(*ctx.shape[:2], n, ctx.shape[3])
        grads = _exchange(list(grad.unbind(0)), like, group, exchange_plan(c, n, window), r, c, backward=True)
        return torch.cat(grads, dim=2), None, None


def windowed_context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, scale: float,
                               window: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's queries ``[b, heads, 2n, d]`` (chunks r and 2c-1-r) through a sliding window over the
    whole sequence; k, v ``[b, kv_heads, 2n, ·]`` (kv_heads divides heads: they travel unrepeated)."""
    c, r = group_size(group), group_rank(group)
    n, groups = q.shape[2] // 2, q.shape[1] // k.shape[1]
    sizes = [k.shape[-1], v.shape[-1]]
    kv = torch.cat([k, v], dim=-1)
    received = _WindowExchange.apply(kv, group, window)
    where = {key: i for i, key in enumerate(received_order(c, n, window, r))}

    def chunk(index: int) -> torch.Tensor:
        src, slot = owner(index, c)
        return kv[:, :, slot * n:(slot + 1) * n] if src == r else received[where[(src, slot)]]

    outs = []
    for slot, query_chunk in enumerate((r, 2 * c - 1 - r)):
        chunks = key_chunks(query_chunk, n, window)
        keys, values = torch.cat([chunk(i) for i in chunks], dim=2).split(sizes, dim=-1)
        if groups > 1:
            keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        outs.append(local_window_attention(q[:, :, slot * n:(slot + 1) * n], keys, values, window,
                                           q_start=query_chunk * n, k_start=chunks[0] * n, scale=scale, sinks=sinks))
    return torch.cat(outs, dim=2)
