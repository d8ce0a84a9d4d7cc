"""Cross-entropy over logits split by vocabulary, without ever gathering the full logits.

Each rank holds logits for its ``V/t`` vocabulary slice. Three all-reduces of ``[b, s]``-sized tensors
(max, sum of exponentials, target logit) give the exact loss; the backward is the local slice of
``softmax - one_hot`` (Megatron's ``vocab_parallel_cross_entropy``). Vocabulary padding rows (ids at or
beyond the real vocabulary) are masked to ``-inf`` so the padded model computes the same softmax as the
unpadded one.

Memory, as in Megatron: the logits are the largest activation of a GPT (b·s·V/t), so the loss works on
ONE fp32 buffer in place: the fp32 copy of 16-bit logits (the logits themselves when they are fp32) is
shifted, exponentiated and normalised in place, saved as the softmax, and turned into the gradient in
place by the backward. About 6 bytes per logit with bf16 logits (2 + 4), 4 with fp32, where a
straightforward version holds three fp32 copies.
"""

from __future__ import annotations

import torch
from torch import nn

from ptdp.models.layers import mask_padding_
from ptdp.observability import communication
from ptdp.parallel.collectives import all_reduce, group_rank, group_size


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, group) -> torch.Tensor:
    """Set the logits of padding ids (>= ``vocab_size``) in this rank's slice to -inf."""
    local = logits.shape[-1]
    start = group_rank(group) * local
    if start + local <= vocab_size:
        return logits
    ids = torch.arange(start, start + local, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, float("-inf"))


def mask_padded_vocab_(logits: torch.Tensor, vocab_size: int, group) -> torch.Tensor:
    """:func:`mask_padded_vocab` in place on the output of the logit GEMM (no full-size copy): this rank's
    columns are the ids from ``tp_rank * V/t`` on."""
    return mask_padding_(logits, vocab_size, group_rank(group) * logits.shape[-1])


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's in-place vocab-parallel cross entropy (see the module docstring for the memory)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group, inplace_backward: bool):
        # The one fp32 working buffer; with fp32 logits it IS the logits (the logit GEMM does not save its
        # output, so nothing else reads them).
        buf = logits.float()
        logits_max = buf.max(dim=-1).values
        if group_size(group) > 1:
            communication.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX, group=group,
                                     action="logits_max")
        buf.sub_(logits_max.unsqueeze(-1))  # shifted

        local = buf.shape[-1]
        start = group_rank(group) * local
        outside = (target < start) | (target >= start + local)
        local_target = (target - start).masked_fill(outside, 0)
        predicted = buf.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        all_reduce(predicted, group)

        buf.exp_()
        sum_exp = all_reduce(buf.sum(dim=-1), group)
        loss = sum_exp.log() - predicted

        buf.div_(sum_exp.unsqueeze(-1))  # softmax
        ctx.save_for_backward(buf, local_target, outside)
        ctx.inplace_backward = inplace_backward
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        # A second backward through a retained graph after an in-place one fails autograd's version check
        # of the saved softmax ("modified by an inplace operation"), never silently.
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax if ctx.inplace_backward else softmax.clone()
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        return grad.mul_(grad_loss.unsqueeze(-1)), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None,
                                 inplace_backward: bool = True) -> torch.Tensor:
    """Per-token loss ``[b, s]`` for vocabulary-parallel ``logits [b, s, V/t]``.

    Works in place on ``logits`` when they are fp32 (they are overwritten: pass a clone to keep them).
    ``inplace_backward=False`` keeps the saved softmax intact so the graph can be back-propagated twice
    (``retain_graph``, e.g. zero-bubble's split input/weight backward).
    """
    return _VocabParallelCrossEntropy.apply(logits, target, group, inplace_backward)


def language_model_loss(logits: torch.Tensor, labels: torch.Tensor, tp_group=None,
                        inplace_backward: bool = True, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy of vocabulary-parallel logits (overwrites fp32 ``logits``: see
    :func:`vocab_parallel_cross_entropy`, also for ``inplace_backward``): the pipeline stages' loss. With
    per-token ``weights`` (a packed microbatch's loss mask and normalisation, ``ptdp.train.batches``) the
    weighted sum instead."""
    per_token = vocab_parallel_cross_entropy(logits, labels, tp_group, inplace_backward)
    return per_token.mean() if weights is None else (per_token * weights).sum()


class VocabParallelCrossEntropy(nn.Module):
    """The per-token loss a model computes itself (``ptdp.models.layers.CrossEntropy``: multi-token
    prediction's heads) over vocabulary-parallel logits."""

    def __init__(self, tp_group=None):
        super().__init__()
        self.tp_group = tp_group

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, labels, self.tp_group)
