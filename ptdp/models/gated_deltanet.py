"""The Gated DeltaNet layer (Qwen3-Next's ``linear_attention``): linear attention whose per-head state
follows the gated delta rule (``ptdp.models.delta_rule``), in place of softmax attention in the layers
``--experimental-attention-variant gated_delta_net --linear-attention-freq`` picks.

Per token: two projections of the normed input, ``in_proj_qkvz`` (queries, keys, values and the output gate
z) and ``in_proj_ba`` (the write strength β = sigmoid(b) and the decay input a); a causal depthwise
convolution of ``--linear-conv-kernel-dim`` taps over the q, k, v channels followed by SiLU; q and k
L2-normalised; per value head the decay g = -exp(A_log)·softplus(a + dt_bias); the rule; an RMSNorm of each
head's output times SiLU(z) (``GatedRMSNorm``, one weight shared by every head); the output projection.
Grouped heads: ``--linear-num-key-heads`` q/k heads, each read by ``--linear-num-value-heads`` / that many
value heads.

Layout (chosen so that a tensor-parallel split is one contiguous slice of every tensor): all the per-head
rows are grouped by key head, as HF's ``in_proj_qkvz``/``in_proj_ba`` already are -- per key head its q
(K rows), its k (K), its r value heads' v (r·V) and z (r·V); its r b's then its r a's. The convolution's
channels are grouped the same way (per key head its q, k, v channels; HF's ``conv1d`` lists all q, then all
k, then all v: ``ptdp.models.qwen3_next.hf`` permutes). ``A_log``/``dt_bias`` are per value head, in order.

Packed documents (a layout that masks attention, ``--reset-attention-mask``): the state and the
convolution's window restart at every document, so no token reads another document.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ptdp.models import delta_rule
from ptdp.models.documents import DocumentLayout, masks_attention
from ptdp.models.layers import Linear

if TYPE_CHECKING:
    from ptdp.config import ModelConfig


class ShortConvolution(nn.Module):
    """Causal depthwise convolution ``[b, s, C] → [b, s, C]`` then SiLU: channel c at token t is
    Σ_i weight[c, i]·x[c, t - (taps - 1) + i]. ``context``: the ``taps - 1`` tokens before the first
    (another rank's, under context parallelism); None: zeros. ``rows``: the weight's rows of ``x``'s channels
    when ``x`` holds only some (a head-parallel context-parallel rank's)."""

    def __init__(self, channels: int, taps: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, taps))

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, rows: slice | None = None) -> torch.Tensor:
        weight = self.weight if rows is None else self.weight[rows]
        taps = weight.shape[1]
        s = x.shape[1]
        if context is None:
            x = F.pad(x, (0, 0, taps - 1, 0))
        else:
            x = torch.cat([context, x], 1)
        y = F.conv1d(x.transpose(1, 2), weight[:, None, :].to(x.dtype), groups=x.shape[-1])
        return F.silu(y[..., -s:]).transpose(1, 2)


class Decay(nn.Module):
    """The per-value-head decay parameters: g = -exp(A_log)·softplus(a + dt_bias), in fp32."""

    def __init__(self, heads: int):
        super().__init__()
        self.A_log = nn.Parameter(torch.empty(heads))
        self.dt_bias = nn.Parameter(torch.empty(heads))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(a.dtype, torch.float32)
        return -self.A_log.to(dtype).exp() * F.softplus(a.to(dtype) + self.dt_bias.to(dtype))


class GatedRMSNorm(nn.Module):
    """``rmsnorm(x)·w·silu(z)`` over each head's V features, in fp32; ``w`` (starting at 1) is shared by every
    head, so a tensor-parallel rank's gradient of it is partial over its heads."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        work = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(work)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(work) * y * F.silu(z.to(work))).to(x.dtype)


# The rule the layer runs: ``(q, k, v, g, beta, state) -> (out, final state)``; the chunked PyTorch form, or a
# device kernel chosen at start-up (``ptdp.ops``).
Rule = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class GatedDeltaNet(nn.Module):
    """``[b, s, h] → [b, s, h]`` (or, with ``fuse_bias``, the output and a None bias). The head counts are read
    from the weights: a tensor-parallel rank holding some key-head groups runs this same code."""

    def __init__(self, cfg: ModelConfig, fuse_bias: bool = False):
        super().__init__()
        h = cfg.hidden_size
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.key_dim, self.value_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.ratio = nv // nk  # value heads per key head
        group = 2 * self.key_dim + 2 * self.ratio * self.value_dim
        self.in_proj_qkvz = Linear(h, nk * group, bias=False)
        self.in_proj_ba = Linear(h, nk * 2 * self.ratio, bias=False)
        self.conv1d = ShortConvolution(nk * (2 * self.key_dim + self.ratio * self.value_dim), cfg.linear_conv_kernel_dim)
        self.decay = Decay(nv)
        self.out_layernorm = GatedRMSNorm(self.value_dim, cfg.norm_epsilon)
        self.out_proj = Linear(nv * self.value_dim, h, bias=False, skip_bias_add=fuse_bias)
        self.rule: Rule = delta_rule.chunked
        # Context parallelism puts its sequence mixing here: ``(layer, conv_in, g, beta, documents) -> out``
        # on this rank's tokens (``ptdp.parallel.context.linear``).
        self.sequence_mixer: Callable | None = None

    def forward(self, x: torch.Tensor, documents: DocumentLayout | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        return self.out_proj(self.core(self.in_proj_qkvz(x), self.in_proj_ba(x), documents))

    def core(self, qkvz: torch.Tensor, ba: torch.Tensor, documents: DocumentLayout | None = None) -> torch.Tensor:
        """The projections' outputs → the input of the output projection ``[b, s, heads·V]``."""
        b, s, _ = qkvz.shape
        dk, dv, r = self.key_dim, self.value_dim, self.ratio
        groups = qkvz.view(b, s, -1, 2 * dk + 2 * r * dv)
        conv_in = groups[..., :2 * dk + r * dv].reshape(b, s, -1)  # per key head: q, k, v channels
        z = groups[..., 2 * dk + r * dv:].reshape(b, s, -1, dv)
        gates = ba.view(b, s, -1, 2 * r)
        beta = gates[..., :r].reshape(b, s, -1).sigmoid()
        g = self.decay(gates[..., r:].reshape(b, s, -1))
        if self.sequence_mixer is not None:
            out = self.sequence_mixer(self, conv_in, g, beta, documents)
        elif masks_attention(documents):
            out = documents_apply(self.mix, documents, conv_in, g, beta)
        else:
            out = self.mix(conv_in, g, beta)
        return self.out_layernorm(out, z).reshape(b, s, -1)

    def mix(self, conv_in: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, context: torch.Tensor | None = None,
            rows: slice | None = None) -> torch.Tensor:
        """One stretch of tokens with no document boundary inside, from a zero state: ``[b, s, value heads, V]``."""
        out, _ = self.rule(*self.streams(conv_in, g, beta, context, rows), state=None)
        return out.transpose(1, 2)

    def streams(self, conv_in: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, context: torch.Tensor | None = None,
                rows: slice | None = None) -> tuple[torch.Tensor, ...]:
        """The rule's inputs (q, k, v, g, β), heads first ``[b, value heads, s, ·]``: the convolution (after
        ``context``, the previous tokens' tail; ``rows``: :class:`ShortConvolution`'s), q and k L2-normalised, q
        scaled, key heads repeated."""
        b, s, _ = conv_in.shape
        dk, dv, r = self.key_dim, self.value_dim, self.ratio
        mixed = self.conv1d(conv_in, context, rows).view(b, s, -1, 2 * dk + r * dv)
        work = torch.promote_types(mixed.dtype, torch.float32)  # the norms in fp32 at least, as HF and FLA
        q, k = delta_rule.l2norm(mixed[..., :dk].to(work)), delta_rule.l2norm(mixed[..., dk:2 * dk].to(work))
        v = mixed[..., 2 * dk:].reshape(b, s, -1, dv)
        q, k = (x.repeat_interleave(r, 2) if r > 1 else x for x in (q * dk ** -0.5, k))
        return tuple(x.transpose(1, 2) for x in (q, k, v, g, beta))


def documents_apply(fn: Callable[..., torch.Tensor], documents: DocumentLayout, *tensors: torch.Tensor
                    ) -> torch.Tensor:
    """``fn`` on every document of every sample separately (each a batch of one), the outputs put back in
    place: ``[b, s, ...]``."""
    rows = []
    for i, bounds in enumerate(documents.bounds):
        pieces = [fn(*(t[i:i + 1, start:end] for t in tensors)) for start, end in zip(bounds[:-1], bounds[1:])
                  if end > start]
        rows.append(torch.cat(pieces, 1))
    return torch.cat(rows, 0)

