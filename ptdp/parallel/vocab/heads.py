"""The S and T passes of vocabulary parallelism over several output heads at once: the model's, and (issue
41) each multi-token prediction module's, which reads the same output weight.

Every head is a cross-entropy over the logits ``x_k Wᵀ`` of its hidden states ``x_k`` against its targets
(the labels; for MTP module k the labels k places ahead, -1 where none exists). The heads are stacked on a
leading dimension, so S and T run each pass once for all of them: this rank's ``V/(p·t)`` rows of the
logits, their max and sum of exponentials and the target logit (S, joined over the pipeline by C0), then
the loss and the gradients of the logits (T): the weight slice's, and the input's (assembled on the last
stage from C0 with one barrier, summed by C1 with two). Head k's loss is the mean over its positions whose
target exists times ``weights[k]``: the LM loss's factor for the model's head, ``λ/D`` of it for each MTP
module (``--mtp-loss-scaling-factor`` λ), as one process's objective weighs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ptdp.models.layers import mask_padding_, softcap_logits
from ptdp.observability import communication
from ptdp.parallel.collectives import all_gather, group_size


def tp_sum(x: Tensor, group) -> Tensor:
    """``x`` summed over the tensor-parallel ``group``, in place (nothing for one rank)."""
    if group_size(group) > 1:
        communication.all_reduce(x, group=group, action="vocab_sum")
    return x


def tp_max(x: Tensor, group) -> Tensor:
    """``x``'s elementwise maximum over the tensor-parallel ``group``, in place (nothing for one rank)."""
    if group_size(group) > 1:
        communication.all_reduce(x, op=dist.ReduceOp.MAX, group=group, action="vocab_max")
    return x


@dataclass
class Saved:
    """What S keeps for T: the heads' hidden states and exponentials, their targets in this slice."""

    x: Tensor  # [heads, b, s, h]
    e: Tensor  # [heads, b, s, rows]: exp(z - local max)
    local: Tensor  # [heads, b, s]: the target's row in this slice (0 outside)
    outside: Tensor  # [heads, b, s]: the target is not in this slice (or does not exist)
    valid: Tensor  # [heads, b, s]: the target exists
    slope: Tensor | None = None  # [heads, b, s, rows]: d capped / d logit under --final-logit-softcapping


def rows_of(ids: Tensor, start: int, rows: int) -> tuple[Tensor, Tensor]:
    """(row in the slice ``[start, start + rows)``, outside it) of each id; ids < 0 (none) are outside."""
    outside = (ids < start) | (ids >= start + rows)
    return (ids - start).masked_fill(outside, 0), outside


def capped(z: Tensor, cap: float | None) -> tuple[Tensor, Tensor | None]:
    """``--final-logit-softcapping``: the logits cap·tanh(z/cap), elementwise (a slice caps its own rows), and
    their slope 1 - (capped/cap)², which scales each logit's gradient (0 on the masked padding)."""
    if cap is None:
        return z, None
    z = softcap_logits(z, cap)
    return z, torch.where(torch.isinf(z), 0.0, 1.0 - (z / cap).square())


def s_pass(x: Tensor, targets: Tensor, w: Tensor, start: int, vocab_size: int, tp_group,
           with_input_terms: bool, cap: float | None = None) -> tuple[Tensor, Saved]:
    """S of ``heads`` heads: ``x [heads, b, s, h]`` (the whole sequence), ``targets [heads, b, s]``, this
    slice ``w`` of the output weight starting at row ``start``, soft-capped under ``cap``. Returns the
    statistics C0 gathers (``[heads, b, s, 3]``: local max, sum of exponentials, target logit; with
    ``with_input_terms`` (one barrier) also ``exp(z - max) W`` and the target rows, each row scaled by its
    logit's slope under a cap, ``[.., 3 + 2h]``) and what T needs."""
    z, slope = capped(mask_padding_(F.linear(x, w).float(), vocab_size, start), cap)
    lmax = tp_max(z.max(dim=-1).values, tp_group).clamp_(min=-1e30)
    z.sub_(lmax.unsqueeze(-1))
    local, outside = rows_of(targets, start, w.shape[0])
    target = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).add_(lmax).masked_fill_(outside, 0.0)
    e = z.exp_()
    packed = torch.stack([lmax, tp_sum(e.sum(dim=-1), tp_group), tp_sum(target, tp_group)], dim=-1)
    if with_input_terms:
        rows = F.embedding(local, w).float().masked_fill_(outside.unsqueeze(-1), 0.0)
        if slope is not None:
            rows.mul_(slope.gather(-1, local.unsqueeze(-1)))
        a = tp_sum((e if slope is None else e * slope) @ w.float(), tp_group)
        packed = torch.cat([packed, a, tp_sum(rows, tp_group)], dim=-1)
    return packed, Saved(x, e, local, outside, targets >= 0, slope)


@dataclass
class TResult:
    """T's outcome: the heads' losses (the last stage's), the weight slice's gradient, and the input
    gradient's share (``partial``: this rank's, two barriers) or whole (``whole``: the last stage's, one)."""

    losses: Tensor | None  # [heads]: each head's mean cross-entropy over its positions with a target
    weight_grad: Tensor
    partial: Tensor | None = None
    whole: Tensor | None = None


def t_pass(gathered: Tensor, saved: Saved, w: Tensor, rank: int, weights: Tensor, last: bool, barriers: int,
           forward_only: bool, dtype: torch.dtype, tp_group: Any, token_weights: Tensor | None = None) -> TResult:
    """T from the C0-gathered statistics ``[p, heads, b, s, k]``: rescale each rank's sum to the global max,
    the loss (``last``), and unless ``forward_only`` the gradients of the heads' objective
    ``Σ_k weights[k] · mean CE_k``. ``token_weights`` ``[b, s]`` (a packed microbatch's loss mask and
    normalisation, ``ptdp.train.batches``) turns the model head's mean into the weighted sum."""
    lmaxs = gathered[..., 0]
    gmax = lmaxs.max(dim=0).values
    c = (lmaxs - gmax).exp_()  # each rank's rescaling to the global max
    gsum = (c * gathered[..., 1]).sum(dim=0)
    valid = saved.valid
    counts = valid.flatten(1).sum(dim=1)  # [heads]: positions with a target
    losses = None
    if last:
        ce = gsum.log() + gmax - gathered[..., 2].sum(dim=0)
        losses = (ce * valid).flatten(1).sum(dim=1) / counts
        if token_weights is not None:
            losses[0] = (ce[0] * token_weights).sum()
    if forward_only:
        return TResult(losses, torch.empty(0))
    x, e, local, outside = saved.x, saved.e, saved.local, saved.outside
    gscale = (weights.double() / counts).float().view(-1, 1, 1) * valid  # [heads, b, s]: d objective / d CE
    if token_weights is not None:
        gscale[0] = token_weights * float(weights[0])
    factor = c / gsum  # [p, heads, b, s]
    grad = e.mul_((factor[rank] * gscale).unsqueeze(-1))  # softmax of this slice, scaled
    grad.scatter_add_(-1, local.unsqueeze(-1), (-gscale * (~outside).float()).unsqueeze(-1))
    if saved.slope is not None:  # through the cap (the one-barrier input terms carry it from S)
        grad.mul_(saved.slope)
    result = TResult(losses, grad.flatten(0, -2).t() @ x.flatten(0, -2).float())
    if barriers == 2:
        result.partial = tp_sum((grad @ w.float()).to(dtype), tp_group)
    elif last:
        h = x.shape[-1]
        a, b = gathered[..., 3:3 + h], gathered[..., 3 + h:]
        result.whole = gscale.unsqueeze(-1) * ((factor.unsqueeze(-1) * a).sum(dim=0) - b.sum(dim=0))
    return result


def gather_sequence(x: Tensor, tp_group, sequence_parallel: bool) -> Tensor:
    """The heads' hidden states over the whole sequence (``[heads, b, s, h]``): all-gathered over the
    tensor-parallel group under sequence parallelism."""
    return all_gather(x, tp_group, dim=2) if sequence_parallel else x
