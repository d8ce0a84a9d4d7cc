"""Global gradient norm across TP, PP (and DP shards), and clipping to ``--clip-grad``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..tensor_parallel.mappings import group_size


def counts_in_grad_norm(param: nn.Parameter, tp_rank: int) -> bool:
    """Whether this rank's copy of ``param`` is counted in the global norm (each element exactly once).

    Replicated across TP (LayerNorm, row-parallel biases): only TP rank 0 counts it. The last stage's
    copy of the tied embedding is never counted: the first stage's is.
    """
    if getattr(param, "is_embedding_copy", False):
        return False
    return getattr(param, "tensor_model_parallel", False) or tp_rank == 0


@torch.no_grad()
def global_grad_norm(counted: Sequence[torch.Tensor], groups: Iterable, device: torch.device) -> float:
    """sqrt of the sum of squares of ``counted`` over every rank of ``groups`` (each a process group).

    Every element must be counted on exactly one rank of the union of ``groups``: DP replicas that hold
    equal grads are left out of ``groups``; DP shards (distributed optimizer) are summed over. A
    non-finite result (an fp16 overflow) stays non-finite on every rank, so all agree to skip the step.
    """
    total = torch.zeros((), dtype=torch.float32, device=device)
    if counted:  # one fused kernel over the list (as torch's clip_grad_norm_), not one op per tensor
        total = torch.stack(torch._foreach_norm([g.float() for g in counted], 2.0)).square().sum()
    for group in groups:
        if group_size(group) > 1:
            dist.all_reduce(total, group=group)
    return total.sqrt().item()


@torch.no_grad()
def clip_grads(grads: Sequence[torch.Tensor], max_norm: float, norm: float) -> None:
    """Scale ``grads`` in place so that their global ``norm`` becomes ``max_norm`` (0 disables)."""
    if max_norm > 0 and norm > max_norm:
        torch._foreach_mul_(list(grads), max_norm / (norm + 1e-6))

