"""The load-balancing loss when a rank routes only part of each sequence (sequence or context parallelism).

Switch's loss ``α·E·Σ_i f_i·P_i`` (f_i: share of the assignments that chose expert i, P_i: mean router
probability of i) is a function of the *whole* token set: computed over a rank's s/t (sequence parallel) or
s/c (context parallel) tokens it is another number. Megatron-Core all-reduces the routing counts over the
tensor-and-context group; so does this: each rank computes

    aux_r = α·E·Σ_i f_i · (Σ_{its tokens} p_i) / T,    f_i from the counts summed over the group, T all tokens

so that Σ_r aux_r is the one-process loss and each rank's gradient with respect to its own probabilities is
the one-process one (f_i carries no gradient). The partial losses then add up where the gradients do: the
router's weight is marked ``sequence_parallel`` under sequence parallelism (summed over TP), and under
context parallelism gradients are averaged over the d·c ranks, so each aux_r is scaled by c.

The z-loss ``β·mean(logsumexp²)`` is a mean over tokens: each rank's mean over its own tokens is right
under context parallelism (the gradients are averaged), and divided by t under sequence parallelism (the
router's gradients are summed over TP). Installed by overriding the router's ``_load_balancing_loss`` and
wrapping its ``forward`` (``ptdp.models.moe.TopKRouter``) from outside.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ptdp.parallel.collectives import all_reduce, group_size


def split_sequence_load_balancing(router: nn.Module, group, scale: float, z_loss_scale: float = 1.0) -> None:
    """Make ``router``'s load-balancing loss this rank's share of the loss over ``group``'s tokens (the
    ranks that hold one sequence between them), times ``scale`` (c), and its z-loss times ``z_loss_scale``
    (1/t under sequence parallelism): see the module doc."""

    def load_balancing_loss(logits: torch.Tensor, indices: torch.Tensor, num_sequences: int) -> torch.Tensor:
        e = router.num_experts
        groups = num_sequences if router.load_balancing == "seq_aux_loss" else 1
        scores = router.balance_scores(logits).view(groups, -1, e)
        chosen = F.one_hot(indices, e).sum(1).view(groups, -1, e).float()
        counts = all_reduce(chosen.sum(1), group)  # [groups, E] over the whole sequences
        tokens = chosen.shape[1] * group_size(group)
        f = counts / (tokens * router.topk)
        return scale * router.aux_coeff * e * (f * scores.sum(1) / tokens).sum(-1).mean()

    router._load_balancing_loss = load_balancing_loss
    if z_loss_scale != 1.0:
        route = router.forward

        def forward(x: torch.Tensor, num_sequences: int = 1):
            probs, indices, aux = route(x, num_sequences)
            if "z_loss" in aux:
                aux["z_loss"] = aux["z_loss"] * z_loss_scale
            return probs, indices, aux

        router.forward = forward
