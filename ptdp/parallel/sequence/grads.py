"""Sequence parallelism outside the layers: the gradient all-reduce of sequence-split regions.

Under sequence parallelism (Korthikanti et al.; ptdp-facts.md, §Memory) each tensor-parallel rank runs
LayerNorm and the row-parallel bias on its own s/t tokens, so the gradients of those replicated
parameters are partial sums over the tokens. Summing them over the TP group after the backward makes them
the gradients of the whole sequence again, equal on every TP rank (so the grad norm counts them once,
on TP rank 0). Their placements say so (``Placement.sequence_parallel``, recorded by the tensor- and
expert-parallel apply steps: ``ptdp.parallel.placement``).

Run it after the data-parallel gradient sync (as Megatron's ``finalize_model_grads`` does), so it never
races an overlapped DP reduction; sum over TP and average over DP commute. With the distributed optimizer
only this rank's DP shard is valid afterwards, and every TP rank has the same shard layout, so the shard's
elements are still summed correctly.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ptdp.parallel.collectives import all_reduce, group_size
from ptdp.parallel.placement import Placements


def sequence_parallel_grads(params: Iterable[nn.Parameter], placements: Placements) -> list[torch.Tensor]:
    """The gradients of the ``sequence_parallel`` ones of ``params``, in their order: the fp32
    ``main_grad`` where mixed precision keeps one."""
    grads = (main if (main := getattr(p, "main_grad", None)) is not None else p.grad
             for p in params if placements.sequence_parallel(p))
    return [g for g in grads if g is not None]


@torch.no_grad()
def all_reduce_sequence_parallel_grads(params: Iterable[nn.Parameter], tp_group, placements: Placements) -> None:
    """Sum the ``sequence_parallel`` parameters' gradients over the TP group, in one flat all-reduce."""
    grads = sequence_parallel_grads(params, placements)
    if not grads or group_size(tp_group) == 1:
        return
    flat = all_reduce(_flatten_dense_tensors(grads), tp_group)
    for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(synced)
