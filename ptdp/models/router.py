"""The MoE router (``ptdp.models.moe``'s step 1): router logits, scores, top-k choice, auxiliary losses,
the capacity drop, and DeepSeek-V3's expert bias with its update after each optimizer step.
Kept apart from ``moe.py`` so each stays one short module; ``ptdp.models.moe`` re-exports its names."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ptdp.models.layers import in_backward
from ptdp.ops.weight_grad import linear

if TYPE_CHECKING:
    from ptdp.config import MoEConfig


def expert_capacity(num_tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """Megatron's capacity: ``ceil(num_tokens · k / E · factor)`` assignments per expert."""
    return math.ceil(num_tokens * topk / num_experts * factor)


class TopKRouter(nn.Module):
    """Router logits ``x Wᵀ`` (``W [E, h]``), scores, top-k selection, auxiliary losses and the capacity drop.

    Scores (``--moe-router-score-function``): softmax (see the module docstring), or sigmoid (DeepSeek-V3):
    the k chosen sigmoid scores normalised to sum 1 (k > 1). Options, Megatron-Core's semantics:

    - expert bias (``--moe-router-enable-expert-bias``, auxiliary-loss-free balancing): a per-expert
      ``expert_bias`` buffer (fp32, checkpointed, not trained) is added to the scores for the CHOICE only;
      the weights are the unbiased scores. The router counts the tokens each expert received in training
      forwards (``tokens_per_expert``, after any drop); after each optimizer step the trainer calls
      :func:`update_expert_biases`, which moves the bias by ``rate · sign(mean load - load_i)``.
    - group-limited routing (``--moe-router-num-groups G``, ``--moe-router-group-topk g``): the experts in G
      equal groups; each token keeps the g groups with the highest sum of their top k/g scores, then its
      top-k among their experts (DeepSeek's node-limited routing: with k/g = 2, HF's DeepSeek-V3 router).
    - ``--moe-router-topk-scaling-factor``: the k weights are multiplied by it (DeepSeek-V3's 2.5).
    """

    def __init__(self, hidden_size: int, moe: MoEConfig):
        super().__init__()
        self.num_experts, self.topk = moe.num_experts, moe.moe_router_topk
        self.pre_softmax = moe.moe_router_pre_softmax
        self.sigmoid = moe.moe_router_score_function == "sigmoid"
        self.num_groups, self.group_topk = moe.moe_router_num_groups, moe.moe_router_group_topk
        self.scaling_factor = moe.moe_router_topk_scaling_factor
        self.load_balancing = moe.moe_router_load_balancing_type
        self.aux_coeff, self.z_coeff = moe.moe_aux_loss_coeff, moe.moe_z_loss_coeff
        self.capacity_factor = moe.moe_expert_capacity_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, hidden_size))
        # --moe-linear-bias: a learned bias on the logits (GPT-OSS), before the top-k and the softmax
        self.bias = nn.Parameter(torch.zeros(self.num_experts)) if moe.moe_linear_bias else None
        self.bias_update_rate = moe.moe_router_bias_update_rate
        bias = moe.moe_router_enable_expert_bias
        self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32) if bias else None)
        self.register_buffer("tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.int64) if bias else None,
                             persistent=False)

    def forward(self, x: Tensor, num_sequences: int = 1) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """``x [T, h]`` (``num_sequences`` sequences of T/num_sequences tokens, one after the other) →
        ``probs [T, k]`` (fp32), ``indices [T, k]`` (``E`` = dropped), the auxiliary losses (with their
        coefficients; only those enabled)."""
        logits = linear(x, self.weight, self.bias).float()
        if self.sigmoid:
            scores = torch.sigmoid(logits)
            choice = scores if self.expert_bias is None else scores + self.expert_bias
            indices = self._topk(choice)[1]
            probs = scores.gather(1, indices)
            if self.topk > 1:
                probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        elif self.pre_softmax:
            probs, indices = self._topk(torch.softmax(logits, dim=-1))
        else:
            top, indices = self._topk(logits)
            probs = torch.softmax(top, dim=-1)
        if self.scaling_factor:
            probs = probs * self.scaling_factor
        aux: dict[str, Tensor] = {}
        if self.load_balancing != "none" and self.aux_coeff > 0.0:
            aux["load_balancing_loss"] = self._load_balancing_loss(logits, indices, num_sequences)
        if self.z_coeff:
            aux["z_loss"] = self.z_coeff * torch.logsumexp(logits, dim=-1).square().mean()
        if self.capacity_factor is not None:
            probs, indices = self._drop(probs, indices)
        if self.expert_bias is not None and self.training and not in_backward():
            with torch.no_grad():
                self.tokens_per_expert += torch.bincount(indices.flatten(), minlength=self.num_experts + 1)[:-1]
        return probs, indices, aux

    def _topk(self, scores: Tensor) -> tuple[Tensor, Tensor]:
        """The k highest ``scores [T, E]`` per token, within its best groups under group-limited routing."""
        if self.num_groups:
            t, groups = scores.shape[0], self.num_groups
            best = scores.view(t, groups, -1).topk(self.topk // self.group_topk, dim=-1).values.sum(dim=-1)
            chosen = torch.zeros_like(best).scatter(1, best.topk(self.group_topk, dim=-1, sorted=False).indices, 1.0)
            allowed = chosen.bool().unsqueeze(-1).expand(t, groups, self.num_experts // groups).reshape(t, -1)
            scores = scores.masked_fill(~allowed, float("-inf"))
        return scores.topk(self.topk, dim=-1)

    def _apply(self, fn, recurse: bool = True):
        """``Module.to(dtype)`` casts floating buffers too; the expert bias stays fp32, as in Megatron-Core:
        its 1e-3 steps would vanish at 16 bits."""
        bias = self.expert_bias
        super()._apply(fn, recurse)
        if bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = bias.to(self.expert_bias.device)
        return self

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: Tensor) -> None:
        """``b_i += rate · sign(mean load - load_i)`` from this step's token counts (summed over the ranks
        that routed other tokens of the same batch), then a new count starts."""
        load = tokens_per_expert.to(torch.float64)
        self.expert_bias += torch.sign(load.mean() - load).to(torch.float32) * self.bias_update_rate
        self.tokens_per_expert.zero_()

    def _load_balancing_loss(self, logits: Tensor, indices: Tensor, num_sequences: int) -> Tensor:
        """Switch's ``α·E·Σ_i f_i·P_i`` (f_i: share of the T·k assignments that chose expert i, before any
        drop; P_i: mean score of i: its softmax probability, or its sigmoid normalised over the E experts),
        over the micro-batch or (seq_aux_loss) per sequence, averaged over sequences."""
        e = self.num_experts
        groups = num_sequences if self.load_balancing == "seq_aux_loss" else 1
        scores = self.balance_scores(logits).view(groups, -1, e)
        chosen = F.one_hot(indices, e).sum(1).view(groups, -1, e).float()
        f = chosen.sum(1) / (chosen.shape[1] * self.topk)
        return self.aux_coeff * e * (f * scores.mean(1)).sum(-1).mean()

    def balance_scores(self, logits: Tensor) -> Tensor:
        """``[T, E]`` the scores P_i of the load-balancing loss averages: the softmax probabilities, or the
        sigmoid scores normalised over the E experts."""
        if not self.sigmoid:
            return torch.softmax(logits, dim=-1)
        scores = torch.sigmoid(logits)
        return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)

    def _drop(self, probs: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:
        """Keep each expert's ``capacity`` most probable assignments; the rest get index E, probability 0."""
        t, e = probs.shape[0], self.num_experts
        capacity = min(expert_capacity(t, self.topk, e, self.capacity_factor), t)
        dense = probs.new_zeros(t, e).scatter(1, indices, probs)
        routed = torch.zeros(t, e, dtype=torch.bool, device=probs.device).scatter(1, indices, True)
        keep = torch.zeros_like(routed).scatter(0, dense.topk(capacity, dim=0).indices, True) & routed
        kept = keep.gather(1, indices)
        return probs.masked_fill(~kept, 0.0), indices.masked_fill(~kept, e)


def update_expert_biases(modules: list[nn.Module], reduce: Callable[[Tensor], Tensor] | None = None) -> None:
    """After each optimizer step: every router with an expert bias moves it from the token counts of the
    step (:meth:`TopKRouter.update_expert_bias`). ``reduce`` sums the ``[routers, E]`` counts over the ranks
    that routed other tokens of the same batch (one collective for all layers; identity in one process), so
    that every layout moves the biases as one process would."""
    routers = [m for chunk in modules for m in chunk.modules() if isinstance(m, TopKRouter) and m.expert_bias is not None]
    if not routers:
        return
    counts = torch.stack([r.tokens_per_expert for r in routers])
    counts = reduce(counts) if reduce is not None else counts
    for router, count in zip(routers, counts, strict=True):
        router.update_expert_bias(count)
