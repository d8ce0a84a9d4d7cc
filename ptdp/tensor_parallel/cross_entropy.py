"""Cross-entropy over logits split by vocabulary, without ever gathering the full logits.

Each rank holds logits for its ``V/t`` vocabulary slice. Three all-reduces of ``[b, s]``-sized tensors
(max, sum of exponentials, target logit) give the exact loss; the backward is the local slice of
``softmax - one_hot`` (Megatron's ``vocab_parallel_cross_entropy``). Vocabulary padding rows (ids at or
beyond the real vocabulary) are masked to ``-inf`` so the padded model computes the same softmax as the
unpadded one.
"""

from __future__ import annotations

import torch

from .mappings import all_reduce, group_rank, group_size


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, group) -> torch.Tensor:
    """Set the logits of padding ids (>= ``vocab_size``) in this rank's slice to -inf."""
    local = logits.shape[-1]
    start = group_rank(group) * local
    if start + local <= vocab_size:
        return logits
    ids = torch.arange(start, start + local, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, float("-inf"))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group):
        logits = logits.float()
        logits_max = logits.max(dim=-1).values
        if group_size(group) > 1:
            torch.distributed.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        local = logits.shape[-1]
        start = group_rank(group) * local
        outside = (target < start) | (target >= start + local)
        local_target = (target - start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        all_reduce(predicted, group)

        exp = shifted.exp()
        sum_exp = all_reduce(exp.sum(dim=-1), group)
        loss = sum_exp.log() - predicted

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        return grad * grad_loss.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None) -> torch.Tensor:
    """Per-token loss ``[b, s]`` for vocabulary-parallel ``logits [b, s, V/t]``."""
    return _VocabParallelCrossEntropy.apply(logits, target, group)
