"""Grouped linear: each local expert's GEMM over its own contiguous rows of tokens, weight grads deferrable.

``x`` is ``[N, in]`` sorted by expert (``counts[e]`` rows for expert e, in order); ``weight`` is the stacked
expert weight ``[E, ..., in]`` (flattened to ``[E, out, in]`` inside, like ``ptdp.ops.weight_grad.linear``).
Row block e of the output is ``x_e @ W_eᵀ``. Two ways to compute the same thing:

- ``grouped=True``: one ``torch._grouped_mm`` call for all experts (forward, input grad and weight grad),
  where the torch build has it and the shapes meet its alignment (rows of 16 bytes); else the loop.
- ``grouped=False``: a loop over experts (one GEMM each; the counts are read on the host).

The backward is explicit (not autograd's derivative of ``_grouped_mm``, which does not accept every
stride on the CPU), and its weight gradient goes through the same :func:`deferring_store` as the other
weight-bearing ops: a zero-bubble W pass computes the expert weight grads too.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ptdp.ops.weight_grad import WeightGrads, deferring_store

_SUPPORT: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs on this device and dtype (tried once, on a tiny problem)."""
    key = (device.type, dtype)
    if key not in _SUPPORT:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                a = torch.zeros(8, 16, device=device, dtype=dtype)
                b = torch.zeros(2, 16, 16, device=device, dtype=dtype)
                torch._grouped_mm(a, b, offs=torch.tensor([4, 8], device=device, dtype=torch.int32))
            except (RuntimeError, NotImplementedError):
                ok = False
        _SUPPORT[key] = ok
    return _SUPPORT[key]


def _aligned(*sizes: int, dtype: torch.dtype) -> bool:
    width = torch.empty((), dtype=dtype).element_size()
    return all(size * width % 16 == 0 for size in sizes)


def _use_grouped(x: Tensor, w: Tensor, grouped: bool) -> bool:
    return (grouped and _aligned(w.shape[1], w.shape[2], dtype=x.dtype)
            and grouped_mm_available(x.device, x.dtype))


def _offsets(counts: Tensor, device: torch.device) -> Tensor:
    return counts.to(device=device).cumsum(0).to(torch.int32)


def _host_counts(counts: Tensor) -> list[int]:
    return [int(c) for c in counts.tolist()]


def _forward(x: Tensor, w: Tensor, counts: Tensor, grouped: bool) -> Tensor:
    """``[N, in] x [E, out, in] -> [N, out]``, block e of rows through expert e."""
    if _use_grouped(x, w, grouped):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=_offsets(counts, x.device))
    parts = x.split(_host_counts(counts))
    return torch.cat([p @ w[e].t() for e, p in enumerate(parts)]) if parts else x.new_zeros(0, w.shape[1])


def _input_grad(g: Tensor, w: Tensor, counts: Tensor, grouped: bool) -> Tensor:
    if _use_grouped(g, w, grouped):
        return torch._grouped_mm(g, w, offs=_offsets(counts, g.device))
    parts = g.split(_host_counts(counts))
    return torch.cat([p @ w[e] for e, p in enumerate(parts)]) if parts else g.new_zeros(0, w.shape[2])


def _weight_grad(g: Tensor, x: Tensor, w: Tensor, counts: Tensor, grouped: bool) -> Tensor:
    """``dW_e = g_eᵀ x_e`` for every local expert (zeros for an expert without tokens)."""
    if _use_grouped(x, w, grouped):
        dw = torch._grouped_mm(g.t(), x, offs=_offsets(counts, x.device))
        # an expert without tokens has a zero gradient, whatever a kernel leaves in its block
        return dw.masked_fill_((counts.to(dw.device) == 0).view(-1, 1, 1), 0.0)
    sizes = _host_counts(counts)
    return torch.stack([ge.t() @ xe for ge, xe in zip(g.split(sizes), x.split(sizes), strict=True)])


def grouped_linear(x: Tensor, weight: Tensor, counts: Tensor, grouped: bool = False) -> Tensor:
    """Rows of ``x`` (sorted by expert, ``counts`` per expert) through their expert's ``weight[e]``."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return _forward(x, weight.flatten(1, -2), counts, grouped)
    return _GroupedLinear.apply(x, weight, counts, grouped)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, counts: Tensor, grouped: bool) -> Tensor:
        ctx.save_for_backward(x, weight, counts)
        ctx.param, ctx.grouped = weight, grouped
        return _forward(x, weight.flatten(1, -2), counts, grouped)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, counts = ctx.saved_tensors
        w_param, grouped = ctx.param, ctx.grouped
        w = weight.flatten(1, -2)
        grad = grad.contiguous()
        dx = _input_grad(grad, w, counts, grouped) if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return dx, None, None, None

        def weight_grads() -> WeightGrads:
            return [(w_param, _weight_grad(grad, x, w, counts, grouped).view(w_param.shape))]

        store = deferring_store(w_param)
        if store is None:
            return dx, weight_grads()[0][1], None, None
        store.add(weight_grads)
        return dx, None, None, None
