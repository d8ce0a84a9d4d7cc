"""FlexAttention for the attention the SDPA kernels cannot express: sliding windows, attention sinks and
soft-capped scores (Gemma 3, GPT-OSS), alone or inside packed documents.

* the mask is a ``BlockMask`` of window ∩ causal ∩ same document, so the 128 x 128 blocks wholly outside every
  window (or every document) are skipped and the full ones run without a mask: O(s·w) work, as the exact
  tiles' (``ptdp.models.window``);
* the cap is a ``score_mod`` (cap·tanh(score/cap), before the mask);
* the sinks are applied after the kernel from the log-sum-exp it returns: softmax over the keys and one more
  logit z is the keys' softmax times sigmoid(lse - z) (``ptdp.models.sinks.sink_rescale``), differentiable
  through the lse.

Which path a process runs is chosen once, at start-up (:func:`select_window_attention`, one line saying which):
on CUDA, without attention dropout (FlexAttention has none), FlexAttention compiled once, if a tiny forward
and backward of it agrees with a naive masked softmax; otherwise, and on the CPU, the exact tiles (torch's
FlexAttention on the CPU has no backward: "FlexAttention does not support backward on CPU"). The exact path
is the reference every layout and the tests compare against. ``$PTDP_WINDOW_ATTENTION`` (``exact`` or
``flex``) forces one; on the CPU forced flex runs eagerly (unfused, forward only: tests).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

from ptdp.ops.document_attention import document_ids

OVERRIDE = "PTDP_WINDOW_ATTENTION"
KERNELS = ("flex", "exact")


@functools.cache
def _flex(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


def _block_mask(s: int, window: int | None, ids: torch.Tensor | None, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = q_idx >= kv_idx
        if window is not None:
            allowed = allowed & (q_idx - kv_idx < window)
        if ids is not None:
            allowed = allowed & (ids[b, q_idx] == ids[b, kv_idx])
        return allowed

    return create_block_mask(mask_mod, None if ids is None else ids.shape[0], None, s, s, device=device)


@functools.lru_cache(maxsize=16)
def _plain_mask(s: int, window: int | None, device: torch.device):
    """The block mask of a window without documents: one per (s, w, device), shared by every layer."""
    return _block_mask(s, window, None, device)


class FlexWindow:
    """The FlexAttention path (module docstring); ``compiled``: through ``torch.compile`` (CUDA)."""

    name = "flex"

    def __init__(self, compiled: bool = True):
        self.compiled = compiled

    def applies(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> bool:
        """Self-attention over the same tokens, equal head widths, no dropout."""
        return dropout_p == 0.0 and q.shape[2] == k.shape[2] and v.shape[-1] == q.shape[-1]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
                 bounds: Sequence[Sequence[int]] | None, cache: dict | None, *, scale: float | None = None,
                 sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
        """q, k, v ``[b, heads, s, d]`` (k, v repeated to the query heads); ``window`` None: causal;
        ``bounds``: per sample its documents' ``cu_seqlens`` and ``cache`` the microbatch's (its block mask)."""
        from torch.nn.attention.flex_attention import AuxRequest

        s = q.shape[2]
        if window is not None and window >= s:
            window = None
        if bounds is None:
            mask = _plain_mask(s, window, q.device)
        else:
            key = ("flex-window", window)
            if cache is None or key not in cache:
                mask = _block_mask(s, window, document_ids(bounds, s, q.device), q.device)
                if cache is not None:
                    cache[key] = mask
            mask = mask if cache is None else cache[key]

        def capped(score, b, h, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)

        out, aux = _flex(self.compiled)(q, k, v, score_mod=capped if softcap is not None else None, block_mask=mask,
                                        scale=scale, return_aux=AuxRequest(lse=True))
        if sinks is None:
            return out
        weight = torch.sigmoid(aux.lse.float() - sinks.float().view(1, -1, 1))
        return out * weight.unsqueeze(-1).to(out.dtype)


def _naive(q, k, v, window, scale, sinks, softcap):
    """The probe's reference: the masked softmax with the cap and the sink, written out."""
    s = q.shape[2]
    i, j = torch.arange(s, device=q.device)[:, None], torch.arange(s, device=q.device)[None, :]
    scores = q @ k.transpose(-1, -2) * scale
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~((j <= i) & (i - j < window)), float("-inf"))
    sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], -1).softmax(-1)[..., :-1] @ v


def _probe(kernel: FlexWindow, device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """Forward and backward of ``kernel`` on a tiny windowed, capped, sinked batch against :func:`_naive`."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, head_dim, generator=gen).to(device, dtype).requires_grad_() for _ in range(3))
    sinks = torch.randn(2, generator=gen).to(device, dtype).requires_grad_()
    out = kernel(q, k, v, 100, None, None, scale=head_dim ** -0.5, sinks=sinks, softcap=5.0)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v, sinks))
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v, sinks)]
    want = _naive(*leaves[:3], 100, head_dim ** -0.5, leaves[3], 5.0)
    tolerance = 1e-3 if dtype == torch.float32 else 5e-2
    for got, ref in zip((out, *grads), (want, *torch.autograd.grad(want.sum(), leaves))):
        if not torch.allclose(got.detach().float(), ref, atol=tolerance, rtol=tolerance):
            raise RuntimeError("FlexAttention disagrees with the masked softmax")


def select_window_attention(device: torch.device, dtype: torch.dtype, dropout: float = 0.0,
                            head_dim: int = 64) -> tuple[FlexWindow | None, str]:
    """The kernel of windowed / sink / capped attention for this process (None: the exact tiles) and the
    start-up line naming it (module docstring)."""
    forced = os.environ.get(OVERRIDE)
    if forced:
        if forced not in KERNELS:
            raise ValueError(f"${OVERRIDE}={forced} is not one of {', '.join(KERNELS)}")
        kernel = FlexWindow(compiled=device.type == "cuda") if forced == "flex" else None
        return kernel, f"windowed attention: {_describe(forced)} (${OVERRIDE})"
    if device.type != "cuda":
        return None, "windowed attention: exact tiles (on the CPU torch's FlexAttention has no backward)"
    if dropout > 0.0:
        return None, "windowed attention: exact tiles (FlexAttention has no dropout)"
    kernel = FlexWindow()
    try:
        _probe(kernel, device, dtype, head_dim)
    except Exception as e:  # any kernel or compiler failure: the exact path
        reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        return None, f"windowed attention: exact tiles (flex unavailable: {reason})"
    return kernel, f"windowed attention: {_describe('flex')}"


def _describe(name: str) -> str:
    return {"flex": "FlexAttention (block mask of window ∩ causal ∩ documents, cap as score_mod, sinks by lse)",
            "exact": "exact tiles"}[name]
