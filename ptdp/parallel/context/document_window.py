"""Packed documents (``--reset-attention-mask``) with sliding windows, attention sinks or soft-capped scores
under context parallelism: the window mask intersected with the document mask, exact on every comm type.

What one process computes (``ptdp.models.window.document_window_attention``): each document of each sample
alone, its queries seeing the keys of their window inside it, with the sinks in the softmax and the capped
scores. Under context parallelism the documents cut across the load-balanced chunks
(``ptdp.parallel.context.documents``), and every rank holds the whole samples' boundaries, so no boundary
travels:

* ``a2a`` (Ulysses): after the all-to-all a rank holds whole samples of its heads/c heads (and their sinks):
  the one-process function runs on them as it is;
* ``allgather``: the keys gathered in natural order; each piece of a query chunk inside one document attends
  to that document's keys of its window (a window of the whole document where the layer has none);
* ``p2p``: a windowed layer (or a capped one: a window of the whole sequence) takes the windowed exchange
  (``ptdp.parallel.context.window``: a key chunk no window reaches never travels) and cuts each query chunk's
  run of keys by the documents the same way; a full layer with sinks keeps the document ring
  (``ptdp.parallel.context.documents``), the sink merged into its log-sum-exp as the causal ring merges it.
"""

from __future__ import annotations

import functools

import torch

from ptdp.models.documents import DocumentLayout
from ptdp.models.window import document_window_attention
from ptdp.parallel.collectives import gather_from_sequence_parallel_region, group_rank, group_size
from ptdp.parallel.context.attention import load_balanced_chunks, natural_order
from ptdp.parallel.context.documents import DocumentRing
from ptdp.parallel.context.ulysses import head_sharded, repeat_kv
from ptdp.parallel.context.window import inside_documents, windowed_context_attention


def document_window_context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                      documents: DocumentLayout, *, cp_group, comm_type: str, scale: float | None,
                                      window: int | None, sinks: torch.Tensor | None = None,
                                      softcap: float | None = None) -> torch.Tensor:
    """This rank's queries ``[b, heads, 2n, d]`` inside the documents of ``documents``, through ``window``
    (None: the whole document), with ``sinks [heads]`` and ``softcap`` when given (module docstring).
    k, v ``[b, kv_heads, 2n, ·]``, kv_heads dividing heads. Same layout as ``context_parallel_attention``."""
    c = group_size(cp_group)
    s = q.shape[2] * c
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if window is not None and window >= s:
        window = None
    bounds = tuple(tuple(int(x) for x in cu) for cu in documents.bounds)
    if comm_type == "a2a":
        sinks = None if sinks is None else sinks.chunk(c)[group_rank(cp_group)]  # this rank's heads' sinks
        return head_sharded(q, k, v, cp_group, functools.partial(document_window_attention, window=window,
                                                                 bounds=bounds, scale=scale, sinks=sinks,
                                                                 softcap=softcap))
    if comm_type == "allgather":
        return _allgather(q, k, v, bounds, cp_group, scale, window, sinks, softcap)
    if window is None and softcap is None:  # sinks over whole documents: the document ring, the sink merged
        return DocumentRing.apply(q, k, v, bounds, cp_group, scale, sinks)
    return windowed_context_attention(q, k, v, cp_group, scale, window or s, sinks, softcap, bounds)


def _allgather(q, k, v, bounds, group, scale: float, window, sinks, softcap) -> torch.Tensor:
    c, r = group_size(group), group_rank(group)
    n, s = q.shape[2] // 2, q.shape[2] * c
    order = natural_order(c, n, q.device)[0]
    k, v = (gather_from_sequence_parallel_region(x, group, dim=2).index_select(2, order) for x in (k, v))
    k, v = repeat_kv(k, v, q.shape[1] // k.shape[1])
    return torch.cat([inside_documents(q[:, :, i * n:(i + 1) * n], k[:, :, :(chunk + 1) * n],
                                        v[:, :, :(chunk + 1) * n], chunk * n, 0, window or s, bounds,
                                        scale=scale, sinks=sinks, softcap=softcap)
                      for i, chunk in enumerate(load_balanced_chunks(c, r))], dim=2)
