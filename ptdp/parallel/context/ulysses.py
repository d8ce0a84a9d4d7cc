"""The Ulysses frame of context parallelism (``--cp-comm-type a2a``; docs/references.md, §Context parallelism):
an all-to-all turns sequence sharding into head sharding, so every rank holds all s tokens of heads/c heads
in natural order; any one-process attention then runs on them unchanged, and a second all-to-all turns the
result back. Causal attention, attention inside packed documents and windows inside documents differ only in
that local call, so they share this frame (``head_sharded``); the Gated DeltaNet mixer uses its all-to-all."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ptdp.observability import communication
from ptdp.parallel.collectives import group_size
from ptdp.parallel.context.layout import natural_order


def repeat_kv(k: torch.Tensor, v: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[b, kv_heads, s, ·]`` with each head repeated ``groups`` times (grouped-query attention
    made plain multi-head attention for kernels that want equal head counts)."""
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)


def _all_to_all(x: torch.Tensor, group, split_dim: int, cat_dim: int) -> torch.Tensor:
    """Rank j gets chunk j of ``x`` along ``split_dim``; what arrives from rank i is concatenated along
    ``cat_dim`` in rank order. One ``all_to_all_single`` (gloo supports it on CPU since torch 2.x)."""
    c = group_size(group)
    send = torch.stack(x.chunk(c, dim=split_dim)).contiguous()
    recv = torch.empty_like(send)
    communication.all_to_all_single(recv, send, group=group, action="cp_a2a")
    return torch.cat(recv.unbind(0), dim=cat_dim)


class AllToAll(torch.autograd.Function):
    """The all-to-all between sequence and head sharding, ``AllToAll.apply(x, group, split_dim, cat_dim)``:
    ``x`` cut c ways along ``split_dim``, the pieces received concatenated along ``cat_dim``. Its backward
    is the inverse all-to-all (the two dimensions swapped)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, split_dim: int, cat_dim: int) -> torch.Tensor:
        ctx.group, ctx.dims = group, (split_dim, cat_dim)
        return _all_to_all(x, group, split_dim, cat_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        split_dim, cat_dim = ctx.dims
        return _all_to_all(grad, ctx.group, cat_dim, split_dim), None, None, None


def head_sharded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group,
                 attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``attend(q, k, v)`` run on whole sequences of this rank's heads/c heads. q ``[b, heads, s/c, d]``,
    k, v ``[b, kv_heads, s/c, ·]`` in the load-balanced layout; ``attend`` gets ``[b, heads/c, s, ·]`` in
    natural token order with K/V repeated to the query heads, and returns the output in that shape. K/V
    heads that do not split c ways are repeated before the all-to-all, otherwise after it (less traffic).
    Returns ``[b, heads, s/c, ·]`` in the load-balanced layout. A caller with per-head parameters (sinks)
    takes this rank's share, ``chunk(c)[rank]``."""
    c, heads = group_size(group), q.shape[1]
    if heads % c:
        raise ValueError(f"--cp-comm-type a2a needs the local attention heads ({heads}) divisible by "
                         f"--context-parallel-size {c}; use --cp-comm-type p2p")
    if k.shape[1] % c:
        k, v = repeat_kv(k, v, heads // k.shape[1])
    order, inverse = natural_order(c, q.shape[2] // 2, q.device)
    q, k, v = (AllToAll.apply(x, group, 1, 2).index_select(2, order) for x in (q, k, v))
    k, v = repeat_kv(k, v, q.shape[1] // k.shape[1])
    return AllToAll.apply(attend(q, k, v).index_select(2, inverse), group, 2, 1)
