"""The ring of ring attention: K/V blocks passed round the CP group, and their gradients after them.

Shared by the causal ring (``ptdp.parallel.context.attention``'s ``_RingAttention``, which states the NCCL
argument) and the packed-documents ring (``ptdp.parallel.context.documents``): each gives a ``visit`` that
computes on the block it holds; the ring decides when blocks travel and when they are waited on, so both
post the same exchanges in the same order on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ptdp.observability import communication
from ptdp.parallel.collectives import group_rank, group_size


def ring_exchange(x: torch.Tensor, group, rank: int, size: int) -> tuple[torch.Tensor, list]:
    """Send ``x`` to the next ring rank and receive the previous rank's into a new buffer, posted as ONE
    ``batch_isend_irecv``: send first, then receive, on every rank. Returns the receive buffer and the works
    to wait on before reading it."""
    recv = torch.empty_like(x)
    nxt = dist.get_global_rank(group, (rank + 1) % size)
    prv = dist.get_global_rank(group, (rank - 1) % size)
    ops = [communication.send_op(x, nxt, group), communication.recv_op(recv, prv, group)]
    works = communication.batch_isend_irecv(ops, group, action="cp_ring")
    return recv, works


def wait_all(works: list) -> None:
    """Wait on each work of an exchange (gloo gives one per operation, NCCL one for the batch)."""
    for work in works:
        work.wait()


def ring_forward(kv: torch.Tensor, group, visit: Callable[[int, torch.Tensor], None]) -> None:
    """``visit(src, kv)`` with the block of each ring rank ``src`` in turn (this rank's own first), the next
    block travelling while this one is computed (c - 1 exchanges)."""
    c, r = group_size(group), group_rank(group)
    for step in range(c):
        if step < c - 1:
            nxt, works = ring_exchange(kv, group, r, c)
        visit((r - step) % c, kv)
        if step < c - 1:
            wait_all(works)
            kv = nxt


def ring_backward(kv: torch.Tensor, group, visit: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """As :func:`ring_forward`, where ``visit(src, kv)`` returns the fp32 gradient of the block it was given
    (shaped like ``kv``): each block's gradient follows it round the ring one step behind, each rank adding
    its own, so after c dK/dV exchanges this rank holds its own block's gradient from every rank."""
    c, r = group_size(group), group_rank(group)
    dkv_in, dkv_works = None, None
    for step in range(c):
        if step < c - 1:
            nxt, kv_works = ring_exchange(kv, group, r, c)
        dkv = visit((r - step) % c, kv)
        if dkv_in is not None:  # the gradient of this block from the ranks it already visited
            wait_all(dkv_works)
            dkv += dkv_in
        dkv_in, dkv_works = ring_exchange(dkv, group, r, c)
        if step < c - 1:
            wait_all(kv_works)
            kv = nxt
    wait_all(dkv_works)  # after c hops this rank's own block is back, with every rank's contribution
    return dkv_in
