"""Causal attention that stops at document boundaries, computing only the blocks inside the documents.

Each kernel takes q, k, v ``[b, heads, s, d]`` (k and v repeated to the query heads) and the boundaries
of each sample (``cu_seqlens``: ``(0, ..., s)``, ``ptdp.data.documents``), and returns ``[b, heads, s, d]``,
token i attending to tokens j <= i of its own document. Which one runs is chosen once, at start-up
(:func:`select_document_attention`, one line saying which):

* ``varlen``: FlashAttention's variable-length kernel (``torch.nn.attention.varlen.varlen_attn``, THD layout
  with the cumulative lengths over the flattened batch) -- CUDA, 16-bit, no dropout;
* ``flex``: FlexAttention with a block mask built per microbatch from the document ids (fully masked
  128 x 128 blocks are skipped, full ones run without a mask), ``flex_attention`` compiled once -- CUDA, no
  dropout. On the CPU torch 2.13's FlexAttention has no backward (eager or compiled: "FlexAttention does
  not support backward on CPU"), so it cannot train there;
* ``per-document``: one causal SDPA call per document (its flash kernel on the CPU): exactly the
  sum of l_i^2 / 2 pairs are computed, any device and dtype, dropout included; the CPU's kernel;
* ``dense``: the fallback, named as such: one SDPA over the whole window with an s x s boolean mask
  (computes, and on the CPU materialises, all s^2 scores).

Context parallelism intersects the same boundaries with its chunks (``ptdp.parallel.context.documents``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

Bounds = Sequence[Sequence[int]]  # per sample: cu_seqlens (0, e1, ..., s)
KERNELS = ("varlen", "flex", "per-document", "dense")
OVERRIDE = "PTDP_DOCUMENT_ATTENTION"  # benchmarks and tests pick a kernel by name


class DocumentAttention(Protocol):
    """One of the kernels above; ``cache`` lives as long as one microbatch's boundaries (its layers share it)."""

    name: str

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: Bounds, dropout_p: float,
                 cache: dict) -> torch.Tensor: ...


def document_ids(bounds: Bounds, s: int, device: torch.device) -> torch.Tensor:
    """``[b, s]`` int32: the index of each token's document in its sample."""
    ids = torch.zeros(len(bounds), s, dtype=torch.int32)
    for i, cu in enumerate(bounds):
        for j, (a, e) in enumerate(zip(cu[:-1], cu[1:])):
            ids[i, a:e] = j
    return ids.to(device)


def dense_mask(bounds: Bounds, s: int, device: torch.device) -> torch.Tensor:
    """``[b, 1, s, s]`` bool, True = attend: same document and causal."""
    ids = document_ids(bounds, s, device)
    causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    return (ids[:, None, :, None] == ids[:, None, None, :]) & causal


@dataclass(frozen=True)
class PerDocument:
    """One causal SDPA per document of each sample (module docstring)."""

    name: str = "per-document"

    def __call__(self, q, k, v, bounds, dropout_p, cache):
        rows = []
        for i, cu in enumerate(bounds):
            parts = [F.scaled_dot_product_attention(q[i:i + 1, :, a:e], k[i:i + 1, :, a:e], v[i:i + 1, :, a:e],
                                                    dropout_p=dropout_p, is_causal=True)
                     for a, e in zip(cu[:-1], cu[1:])]
            rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
        return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)


@dataclass(frozen=True)
class Dense:
    """The fallback: SDPA with the s x s document mask."""

    name: str = "dense"

    def __call__(self, q, k, v, bounds, dropout_p, cache):
        if "dense" not in cache:
            cache["dense"] = dense_mask(bounds, q.shape[2], q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=cache["dense"], dropout_p=dropout_p)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_block_mask(bounds: Bounds, s: int, device: torch.device):
    """FlexAttention's ``BlockMask`` of the document-causal mask (built from the document ids)."""
    from torch.nn.attention.flex_attention import create_block_mask

    ids = document_ids(bounds, s, device)

    def mask_mod(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)

    return create_block_mask(mask_mod, len(bounds), None, s, s, device=device)


@dataclass(frozen=True)
class Flex:
    """FlexAttention with the document block mask, compiled once (module docstring)."""

    name: str = "flex"

    def __call__(self, q, k, v, bounds, dropout_p, cache):
        if "flex" not in cache:
            cache["flex"] = flex_block_mask(bounds, q.shape[2], q.device)
        return _compiled_flex()(q, k, v, block_mask=cache["flex"])


@dataclass(frozen=True)
class Varlen:
    """FlashAttention's variable-length kernel over the flattened batch (module docstring)."""

    name: str = "varlen"

    def __call__(self, q, k, v, bounds, dropout_p, cache):
        from torch.nn.attention.varlen import varlen_attn

        b, h, s, d = q.shape
        if "varlen" not in cache:
            starts = [i * s + a for i, cu in enumerate(bounds) for a in cu[:-1]] + [b * s]
            longest = max(e - a for cu in bounds for a, e in zip(cu[:-1], cu[1:]))
            cache["varlen"] = (torch.tensor(starts, dtype=torch.int32, device=q.device), longest)
        cu, longest = cache["varlen"]
        flat = [x.transpose(1, 2).reshape(b * s, h, d) for x in (q, k, v)]
        out = varlen_attn(*flat, cu, cu, longest, longest, window_size=(-1, 0))
        return out.view(b, s, h, d).transpose(1, 2)


BY_NAME: dict[str, DocumentAttention] = {k.name: k for k in (Varlen(), Flex(), PerDocument(), Dense())}


def _probe(kernel: DocumentAttention, device: torch.device, dtype: torch.dtype) -> None:
    """Forward and backward of ``kernel`` on a tiny packed batch, checked against the per-document kernel:
    a kernel that does not build or disagrees is not chosen."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(2, 2, 256, 64, generator=gen).to(device, dtype).requires_grad_() for _ in range(3))
    bounds = [(0, 100, 256), (0, 7, 130, 131, 256)]
    out = kernel(q, k, v, bounds, 0.0, {})
    out.float().sum().backward()
    want = PerDocument()(q.detach().float(), k.detach().float(), v.detach().float(), bounds, 0.0, {})
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    if not torch.allclose(out.detach().float(), want, atol=tolerance, rtol=tolerance):
        raise RuntimeError(f"{kernel.name} disagrees with per-document SDPA")


def select_document_attention(device: torch.device, dtype: torch.dtype,
                              dropout: float = 0.0) -> tuple[DocumentAttention, str]:
    """The kernel this process uses for document-masked attention, and the one start-up line naming it.

    CUDA: varlen (16-bit), then flex, each probed (``_probe``); the CPU, or with attention dropout:
    per-document. ``$PTDP_DOCUMENT_ATTENTION`` (one of ``KERNELS``) forces one, ``dense`` included."""
    forced = os.environ.get(OVERRIDE)
    if forced:
        if forced not in BY_NAME:
            raise ValueError(f"${OVERRIDE}={forced} is not one of {', '.join(KERNELS)}")
        return BY_NAME[forced], f"document attention: {_describe(forced)} (${OVERRIDE})"
    if device.type != "cuda":
        return BY_NAME["per-document"], ("document attention: per-document SDPA (on the CPU torch's FlexAttention "
                                         "has no backward)")
    if dropout > 0.0:
        return BY_NAME["per-document"], "document attention: per-document SDPA (varlen and flex have no dropout)"
    failed = []
    for name in ("varlen", "flex") if dtype in (torch.float16, torch.bfloat16) else ("flex",):
        try:
            _probe(BY_NAME[name], device, dtype)
            return BY_NAME[name], f"document attention: {_describe(name)}" + (
                f" ({'; '.join(failed)})" if failed else "")
        except Exception as e:  # any kernel or compiler failure: the next kernel
            failed.append(f"{name} unavailable: {str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__}")
    return BY_NAME["per-document"], f"document attention: per-document SDPA ({'; '.join(failed)})"


def _describe(name: str) -> str:
    return {"varlen": "varlen flash attention (cu_seqlens over the batch)",
            "flex": "FlexAttention block masks (compiled)",
            "per-document": "per-document SDPA",
            "dense": "dense SDPA with an s x s mask (the fallback: every masked block computed)"}[name]


@functools.cache
def _chosen(device: torch.device, dtype: torch.dtype) -> DocumentAttention:
    return select_document_attention(device, dtype)[0]


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens,
                       kernel: str | None = None) -> torch.Tensor:
    """Document-causal attention outside a model (benchmarks, the GPU suite): ``cu_seqlens`` one sample's
    boundaries (a sequence or a 1-D tensor; ``q`` of batch 1) or one per sample; ``kernel`` by name, else the
    one :func:`select_document_attention` picks for ``q``'s device and dtype."""
    if isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = cu_seqlens.tolist()
    bounds = [cu_seqlens] if cu_seqlens and isinstance(cu_seqlens[0], int) else cu_seqlens
    chosen = BY_NAME[kernel] if kernel else _chosen(q.device, q.dtype)
    return chosen(q, k, v, [tuple(int(x) for x in cu) for cu in bounds], 0.0, {})
