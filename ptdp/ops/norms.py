"""LayerNorm and RMSNorm whose weight (and bias) grads can be deferred to the zero-bubble W pass.

Same parameters, names and numbers as ``nn.LayerNorm``/``nn.RMSNorm`` (checkpoints do not change). LayerNorm's
backward calls torch's own kernel (``native_layer_norm_backward``) with an ``output_mask``: all grads at
once normally; only the input grad in the I pass while ``ptdp.ops.weight_grad.
defer_weight_grads`` is active, and only the weight/bias grads later in W from the saved input,
statistics and output gradient. RMSNorm writes its backward out (see ``_RMSNorm``). Without grad or
under ``torch.compile`` the plain modules run: weight grads in I, as before; so does LayerNorm for the
parameters ``weight_grad.compute_at_once`` names (torch's backward is the same kernel with the same mask).
RMSNorm keeps its own backward there (torch's composite one is other arithmetic).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ptdp.ops.weight_grad import WeightGrads, at_once, deferring_store, plain_path

_aten = torch.ops.aten


class LayerNorm(nn.LayerNorm):
    def forward(self, x: Tensor) -> Tensor:
        if self.weight is None or at_once(self.weight):
            return super().forward(x)
        return _LayerNorm.apply(x, self.weight, self.bias, list(self.normalized_shape), self.eps)


class RMSNorm(nn.RMSNorm):
    def forward(self, x: Tensor) -> Tensor:
        if plain_path() or self.weight is None or len(self.normalized_shape) != 1:
            return super().forward(x)
        return _RMSNorm.apply(x, self.weight, list(self.normalized_shape), self.eps)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, shape: list[int], eps: float) -> Tensor:
        y, mean, rstd = _aten.native_layer_norm(x, shape, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.shape, ctx.params = shape, (weight, bias)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        w_param, b_param = ctx.params
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        shape = ctx.shape  # the closure must not keep ctx (the graph node) alive

        def grads(mask: list[bool]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
            return _aten.native_layer_norm_backward(grad, x, shape, mean, rstd, weight, bias, mask)

        store = deferring_store(w_param, b_param) if need_w or need_b else None
        if store is None:
            dx, dw, db = grads([need_x, need_w, need_b])
            return dx, dw, db, None, None

        def weight_grads() -> WeightGrads:
            _, dw, db = grads([False, need_w, need_b])
            return [(w_param, dw), (b_param, db)]

        store.add(weight_grads)
        return (grads([True, False, False])[0] if need_x else None), None, None, None, None


class _RMSNorm(torch.autograd.Function):
    """F.rms_norm's own composite formula (fp32 statistics); torch has no CPU ``_fused_rms_norm_backward``,
    so the backward is written out: with n = x·rstd and g' = g·w, dx = rstd·(g' − n·mean(g'·n)),
    dw = Σ g·n over tokens."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, shape: list[int], eps: float | None) -> Tensor:
        xf = x.float()
        eps = torch.finfo(x.dtype).eps if eps is None else eps
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, weight, rstd)
        ctx.param = weight
        return xf.mul(rstd).type_as(x).mul(weight)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, rstd = ctx.saved_tensors
        param = ctx.param
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]

        def weight_grads() -> WeightGrads:
            normed = x.float().mul(rstd).type_as(x)
            return [(param, grad.mul(normed).reshape(-1, grad.shape[-1]).sum(0))]

        dx = None
        if need_x:
            normed = x.float().mul(rstd)
            gw = grad.mul(weight).float()
            dx = rstd * (gw - normed * (gw * normed).mean(-1, keepdim=True))
            dx = dx.type_as(x)
        store = deferring_store(param) if need_w else None
        if store is None:
            return dx, (weight_grads()[0][1] if need_w else None), None, None
        store.add(weight_grads)
        return dx, None, None, None
