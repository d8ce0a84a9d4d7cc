"""Sliding-window attention in tiles: each query attends only to the keys of its window, so the work per
token is O(w), not O(s) (Beltagy et al.'s local attention; Gemma 3 and GPT-OSS's windowed layers).

Query i at position ``q_start + i`` sees key j at position ``k_start + j`` iff ``0 <= (q_start + i) -
(k_start + j) < window``. The queries are cut into tiles of T = min(w, Lq) rows; the keys a tile can see are
one contiguous run of T + w - 1 positions, taken as a strided view of the (padded) keys, so a tile's scores are
T x (T + w - 1) and a layer's (s / T)·T·(T + w - 1) ≈ 2·s·w, whatever s. Plain differentiable ops: exact on
the CPU, autograd gives the backward. The one-process core (``ptdp.models.layers.CausalAttention``) and
context parallelism's windowed layers (``ptdp.parallel.context.window``) both call it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ptdp.ops.fused import outside_compile


def local_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, *, q_start: int = 0,
                           k_start: int = 0, scale: float | None = None, sinks: torch.Tensor | None = None,
                           dropout_p: float = 0.0, softcap: float | None = None) -> torch.Tensor:
    """``q [b, h, Lq, d]``, ``k``/``v [b, h, Lk, d]`` (k, v repeated to the query heads) at positions
    ``q_start + i`` and ``k_start + j``; every query must see at least itself among the keys (``k_start <=
    q_start`` and the keys reaching up to the last query). ``sinks [h]``: one more logit per head
    (``ptdp.models.sinks``); ``softcap``: scores become cap·tanh(score/cap) before the mask and softmax
    (``--attn-logit-softcapping``). Returns ``[b, h, Lq, d_v]``."""
    b, h, lq, d = q.shape
    lk = k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    tile = max(1, min(window, lq))
    tiles = -(-lq // tile)
    span = tile + window - 1  # the keys one tile of queries can see
    first = q_start - (window - 1) - k_start  # index into k of the first key the first tile may see
    left = max(0, -first)
    right = max(0, first + (tiles - 1) * tile + span - lk)
    kp, vp = (F.pad(x, (0, 0, left, right)) for x in (k, v))
    start = first + left
    kw = kp[:, :, start:start + (tiles - 1) * tile + span].unfold(2, span, tile).transpose(-1, -2)
    vw = vp[:, :, start:start + (tiles - 1) * tile + span].unfold(2, span, tile).transpose(-1, -2)
    qt = F.pad(q, (0, 0, 0, tiles * tile - lq)).view(b, h, tiles, tile, d)
    scores = torch.matmul(qt, kw.transpose(-1, -2)) * scale  # [b, h, tiles, T, T + w - 1]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    a = torch.arange(tile, device=q.device)[:, None]
    e = torch.arange(span, device=q.device)[None, :]
    in_window = (e >= a) & (e <= a + window - 1)
    key_index = first + torch.arange(tiles, device=q.device)[:, None, None] * tile + e  # [tiles, 1, span]
    exists = (key_index >= 0) & (key_index < lk)
    scores = scores.masked_fill(~(in_window & exists), float("-inf"))
    if sinks is not None:
        sink = sinks.view(1, -1, 1, 1, 1).to(scores.dtype).expand(b, h, tiles, tile, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p)
    out = torch.matmul(probs.to(vw.dtype), vw)  # [b, h, tiles, T, d_v]
    return out.reshape(b, h, tiles * tile, -1)[:, :, :lq]


@outside_compile  # --compile: the loop runs over host boundaries, as the document kernels' do
def document_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
                              bounds: Sequence[Sequence[int]], *, scale: float | None = None,
                              sinks: torch.Tensor | None = None, dropout_p: float = 0.0,
                              softcap: float | None = None) -> torch.Tensor:
    """Packed documents (``--reset-attention-mask``) with a sliding ``window`` or attention sinks: the window
    mask intersected with the document mask. A document is a contiguous run of tokens and no key outside it
    is seen, so each document of each sample runs :func:`local_window_attention` alone (``window`` None: the
    whole document, i.e. causal inside it, which the sinks' softmax needs too). ``bounds``: per sample its
    ``cu_seqlens (0, ..., s)``. Same shapes as :func:`local_window_attention`."""
    rows = []
    for i, cu in enumerate(bounds):
        parts = []
        for a, e in zip(cu[:-1], cu[1:]):
            if e > a:
                w = e - a if window is None else min(window, e - a)
                parts.append(local_window_attention(q[i:i + 1, :, a:e], k[i:i + 1, :, a:e], v[i:i + 1, :, a:e], w,
                                                    scale=scale, sinks=sinks, dropout_p=dropout_p, softcap=softcap))
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0)
