"""Context-parallel attention over packed documents (``--reset-attention-mask``; docs/packing.md).

The load-balanced layout stays the causal one (``ptdp.parallel.context.attention``: rank i holds chunks i
and 2c-1-i of every sample); the documents cut across it. Every CP rank holds its microbatch's boundaries
for the whole samples (the batch source read the whole samples, ``ptdp.train.batches``), so no boundary
travels: each rank intersects them with the chunks it holds and, for the keys, with the chunks their
owner holds. A query chunk Q and a key chunk K are disjoint or equal; for a document D:

* K before Q: the keys of K∩D are all visible to the queries of Q∩D (an unmasked rectangle);
* K = Q: Q∩D attends to itself causally (a square, aligned: the flash kernels' ``is_causal``);
* K after Q: nothing.

These *pieces* are the only attention computed (sum of l_i^2 / 2 pairs over the ranks, as in one
process). With the ring (``p2p``) each pass of a K/V block computes its pieces with the ring's block
kernel (``block_forward``: flash on the CPU and, in 16-bit, on CUDA; exact math otherwise), merged by
their log-sum-exp into the running output exactly as whole blocks are; a step with no piece computes
nothing but still passes the block on, so the communication is the plain ring's, call for call (its NCCL
argument holds unchanged). With ``allgather`` each query piece attends, through SDPA, to its document's
keys before it in the gathered sequence. With Ulysses (``a2a``) every rank holds whole samples of its heads,
and the layout's own kernel (``ptdp.ops.document_attention``) runs on them.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ptdp.models.documents import DocumentLayout
from ptdp.parallel.collectives import gather_from_sequence_parallel_region, group_rank, group_size
from ptdp.parallel.context.attention import (
    block_backward,
    block_dtype,
    block_forward,
    expand_heads,
    fold_heads,
    load_balanced_chunks,
    merge_block,
    merge_sinks,
    natural_order,
    sinks_grad,
)
from ptdp.parallel.context.ring import ring_backward, ring_forward
from ptdp.parallel.context.ulysses import head_sharded, repeat_kv

Piece = tuple[int, int, int, int, bool]  # local query rows [a, b), local key columns [c, d), causal square


def context_parallel_document_line(comm_type: str) -> str:
    """What the start-up line adds under context parallelism."""
    how = {"p2p": "ring blocks cut into per-document pieces (flash kernels, merged by LSE)",
           "allgather": "gathered keys, per-document pieces through SDPA",
           "a2a": "whole samples per head group after the all-to-all, with that kernel"}[comm_type]
    return f"; context parallel ({comm_type}): {how}"


def chunk_segments(s: int, c: int, rank: int) -> list[tuple[int, int]]:
    """The global token ranges ``[start, end)`` of ``rank``'s two chunks, in its local order."""
    n = s // (2 * c)
    return [(i * n, (i + 1) * n) for i in load_balanced_chunks(c, rank)]


def pieces(bounds: Sequence[int], queries: Sequence[tuple[int, int]],
           keys: Sequence[tuple[int, int]]) -> list[Piece]:
    """The visible pieces (module docstring) of the queries held as the segments ``queries`` against the
    keys held as ``keys`` (each a list of global ranges, concatenated in that order locally), for one
    sample's document boundaries ``bounds``."""
    out: list[Piece] = []
    q_off = 0
    for qa, qb in queries:
        k_off = 0
        for ka, kb in keys:
            if ka < qb:  # K after Q: nothing
                same = (ka, kb) == (qa, qb)
                first = bisect.bisect_right(bounds, qa) - 1
                for j in range(first, len(bounds) - 1):
                    da, db = bounds[j], bounds[j + 1]
                    if da >= qb:
                        break
                    lo, hi = max(qa, da), min(qb, db)
                    if same:
                        out.append((lo - qa + q_off, hi - qa + q_off, lo - ka + k_off, hi - ka + k_off, True))
                        continue
                    k_lo, k_hi = max(ka, da), min(kb, db)
                    if lo < hi and k_lo < k_hi:
                        out.append((lo - qa + q_off, hi - qa + q_off, k_lo - ka + k_off, k_hi - ka + k_off, False))
            k_off += kb - ka
        q_off += qb - qa
    return out


def document_context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentLayout, *,
                               cp_group, comm_type: str) -> torch.Tensor:
    """``context_parallel_attention`` inside the documents of ``documents`` (same shapes and layout)."""
    c = group_size(cp_group)
    if c == 1:
        k, v = repeat_kv(k, v, q.shape[1] // k.shape[1])
        return documents.attend(q, k, v, 0.0)
    scale = 1.0 / math.sqrt(q.shape[-1])
    if comm_type == "a2a":
        return head_sharded(q, k, v, cp_group, lambda q, k, v: documents.attend(q, k, v, 0.0))
    if comm_type == "allgather":
        return _allgather(q, k, v, documents.bounds, cp_group, scale)
    return DocumentRing.apply(q, k, v, tuple(tuple(b) for b in documents.bounds), cp_group, scale, None)


def _allgather(q, k, v, bounds, group, scale: float) -> torch.Tensor:
    """Each (query chunk ∩ document) attends to its document's gathered keys up to its own end: a
    lower-right-aligned causal piece (one SDPA call with that piece's own small mask)."""
    c, r = group_size(group), group_rank(group)
    s = q.shape[2] * c
    order = natural_order(c, q.shape[2] // 2, q.device)[0]
    k, v = (gather_from_sequence_parallel_region(x, group, dim=2).index_select(2, order) for x in (k, v))
    k, v = repeat_kv(k, v, q.shape[1] // k.shape[1])
    rows = []
    for i, cu in enumerate(bounds):
        parts, off = [], 0
        for qa, qb in chunk_segments(s, c, r):
            for j in range(bisect.bisect_right(cu, qa) - 1, len(cu) - 1):
                da, db = cu[j], cu[j + 1]
                if da >= qb:
                    break
                lo, hi = max(qa, da), min(qb, db)
                nq, nk = hi - lo, hi - da
                mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
                parts.append(F.scaled_dot_product_attention(q[i:i + 1, :, off + lo - qa:off + hi - qa],
                                                            k[i:i + 1, :, da:hi], v[i:i + 1, :, da:hi],
                                                            attn_mask=mask, scale=scale))
            off += qb - qa
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0)


class DocumentRing(torch.autograd.Function):
    """``DocumentRing.apply(q, k, v, bounds, group, scale, sinks)``: ring attention over the load-balanced
    layout inside the documents of ``bounds`` (per sample its ``cu_seqlens``, as tuples).

    ``_RingAttention`` (``ptdp.parallel.context.attention``) computing only each block's pieces: the same
    exchanges in the same order (forward: c-1 K/V hops; backward: c-1 K/V and c dK/dV hops). ``sinks
    [heads]``: one more logit per head, merged into the log-sum-exp after the ring as ``_RingAttention``
    merges it (``ptdp.parallel.context.document_window``)."""

    @staticmethod
    def forward(ctx, q, k, v, bounds, group, scale: float, sinks: torch.Tensor | None = None):
        c, r = group_size(group), group_rank(group)
        s, groups = q.shape[2] * c, q.shape[1] // k.shape[1]
        dtype = block_dtype(q)
        qf = q.to(dtype)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        mine = chunk_segments(s, c, r)

        def visit(src: int, kv: torch.Tensor) -> None:
            for i, cu in enumerate(bounds):
                for qa, qb, ka, kb, causal in pieces(cu, mine, chunk_segments(s, c, src)):
                    kb_, vb_ = (expand_heads(x[i:i + 1, :, ka:kb].to(dtype), groups) for x in kv.unbind(0))
                    blk_out, blk_lse = block_forward(qf[i:i + 1, :, qa:qb], kb_, vb_, scale, causal)
                    merge_block(out[i:i + 1, :, qa:qb], lse[i:i + 1, :, qa:qb], blk_out, blk_lse)

        ring_forward(torch.stack([k, v]), group, visit)
        if sinks is not None:  # the sink as one more block
            lse = merge_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, *(() if sinks is None else (sinks,)))
        ctx.bounds, ctx.group, ctx.scale = bounds, group, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *sinks = ctx.saved_tensors
        bounds, group, scale = ctx.bounds, ctx.group, ctx.scale
        dsinks = sinks_grad(sinks[0], out, lse, dout) if sinks else None
        c, r = group_size(group), group_rank(group)
        s, groups = q.shape[2] * c, q.shape[1] // k.shape[1]
        dtype = block_dtype(q)
        qf, do = q.to(dtype), dout.to(dtype)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        mine = chunk_segments(s, c, r)

        def visit(src: int, kv: torch.Tensor) -> torch.Tensor:
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            for i, cu in enumerate(bounds):
                for qa, qb, ka, kb, causal in pieces(cu, mine, chunk_segments(s, c, src)):
                    kb_, vb_ = (expand_heads(x[i:i + 1, :, ka:kb].to(dtype), groups) for x in kv.unbind(0))
                    dq_b, dk_b, dv_b = block_backward(do[i:i + 1, :, qa:qb], qf[i:i + 1, :, qa:qb], kb_, vb_,
                                                      out[i:i + 1, :, qa:qb], lse[i:i + 1, :, qa:qb], scale, causal)
                    dq[i:i + 1, :, qa:qb] += dq_b
                    dkv[0][i:i + 1, :, ka:kb] += fold_heads(dk_b.float(), groups)
                    dkv[1][i:i + 1, :, ka:kb] += fold_heads(dv_b.float(), groups)
            return dkv

        dk, dv = ring_backward(torch.stack([k, v]), group, visit).unbind(0)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, dsinks
