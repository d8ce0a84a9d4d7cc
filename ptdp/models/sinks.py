"""Attention sinks (GPT-OSS; Megatron-Core's ``--softmax-type``): one more logit per head in every query's
softmax, whose probability mass attends to nothing.

``softmax([q·k_j·scale for the allowed j] + [z_head])`` then drop the last column: the probabilities of the
real keys sum to ``1 - p_sink`` < 1, so a head can attend "nowhere". With ``learnable`` z is a parameter
per head (:class:`AttentionSinks`, HF's ``self_attn.sinks``), with ``off-by-one`` it is 0. The same result
is ``softmax_attention(q, k, v) · sigmoid(lse - z)`` where lse is the log-sum-exp of the real scores: the
rescaling by which context parallelism (``ptdp.parallel.context``) applies sinks after merging its blocks.

On the CPU the core is the explicit masked softmax (exact); a tensor-parallel rank holds the sinks of its
heads (the ``HeadSplit`` rule of ``ptdp.models.gpt_sharding``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class AttentionSinks(nn.Module):
    """``weight [heads]``: the sink logit of each head (``learnable``), or a fixed 0 (``off-by-one``: no
    parameter)."""

    def __init__(self, heads: int, learnable: bool = True):
        super().__init__()
        self.heads = heads
        self.weight = nn.Parameter(torch.empty(heads)) if learnable else None

    def forward(self, like: torch.Tensor) -> torch.Tensor:
        """The sink logits ``[heads]`` in ``like``'s dtype and device."""
        if self.weight is None:
            return like.new_zeros(self.heads)
        return self.weight.to(like.dtype)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   allowed: torch.Tensor | None, dropout_p: float = 0.0, scale: float | None = None) -> torch.Tensor:
    """``[b, heads, s, d]`` q, k, v (k, v already repeated to the query heads), ``sinks [heads]``, ``allowed``:
    a boolean ``[s_q, s_k]`` (or broadcastable) mask of the keys each query may see, None: causal.
    The softmax over the allowed scores and the sink, the sink's column dropped, dropout, times V."""
    s_q, s_k = q.shape[-2], k.shape[-2]
    if allowed is None:
        allowed = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril(s_k - s_q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.view(1, -1, 1, 1).to(scores.dtype).expand(scores.shape[0], -1, s_q, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p)
    return torch.matmul(probs.to(v.dtype), v)


def sink_rescale(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``out [b, heads, s, d]``, the attention over the real keys, with ``lse [b, heads, s]`` the log-sum-exp
    of its scores: the output with the sink in the softmax, ``out · sigmoid(lse - z)`` (a query that sees no
    key, lse = -inf, gets 0)."""
    weight = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))
    return out * weight.unsqueeze(-1).to(out.dtype)
