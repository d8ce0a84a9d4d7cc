"""Global gradient norm across TP, PP (and DP shards), and clipping to ``--clip-grad``.

Which rank counts which element is the parameters' placements' business (``Placement.counts_in_norm``,
``ptdp.parallel.placement``): the optimizers pass only the counted gradients here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ptdp.observability import communication
from ptdp.parallel.collectives import group_size


@torch.no_grad()
def global_grad_norm_tensor(counted: Sequence[torch.Tensor], groups: Iterable, device: torch.device) -> torch.Tensor:
    """sqrt of the sum of squares of ``counted`` over every rank of ``groups`` (each a process group),
    as a 0-dim fp32 tensor on ``device``: nothing waits for the GPU here (no host sync in the step).

    Every element must be counted on exactly one rank of the union of ``groups``: DP replicas that hold
    equal grads are left out of ``groups``; DP shards (distributed optimizer) are summed over. A
    non-finite result (an fp16 overflow) stays non-finite on every rank, so all agree to skip the step.
    ``device`` is the model's: a rank that owns no shard still joins the all-reduce with a tensor NCCL
    accepts.
    """
    total = torch.zeros((), dtype=torch.float32, device=device)
    if counted:  # one fused kernel over the list (as torch's clip_grad_norm_), not one op per tensor
        total = torch.stack(torch._foreach_norm([g.float() for g in counted], 2.0)).square().sum()
    for group in groups:
        if group_size(group) > 1:
            communication.all_reduce(total, group=group, action="grad_norm")
    return total.sqrt()


def global_grad_norm(counted: Sequence[torch.Tensor], groups: Iterable, device: torch.device) -> float:
    """:func:`global_grad_norm_tensor` as a Python float (one host sync)."""
    return global_grad_norm_tensor(counted, groups, device).item()


@torch.no_grad()
def clip_grads(grads: Sequence[torch.Tensor], max_norm: float, norm: float | torch.Tensor) -> None:
    """Scale ``grads`` in place so that their global ``norm`` becomes ``max_norm`` (0 disables).

    With a tensor ``norm`` the decision stays on the device, as in ``torch.nn.utils.clip_grad_norm_``:
    the grads are multiplied by ``min(1, max_norm / (norm + 1e-6))`` (times 1.0 is exact, so an unclipped
    step is unchanged), and the host never waits for the norm.
    """
    if max_norm <= 0 or not grads:
        return
    if isinstance(norm, torch.Tensor):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(list(grads), coef.to(grads[0].device))
    elif norm > max_norm:
        torch._foreach_mul_(list(grads), max_norm / (norm + 1e-6))
