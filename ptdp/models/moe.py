"""Mixture-of-experts layer (Megatron-Core's MoE), one process: router, token dispatcher, grouped experts.

A :class:`MoELayer` replaces the MLP of the layers ``--moe-layer-freq`` picks. Per token (T = b·s tokens of
a micro-batch, flattened):

1. ``router`` (:class:`TopKRouter`, weight ``[E, h]``) scores the E experts and keeps k of them: by default
   the top-k logits then a softmax over those k (Megatron's default = Mixtral's softmax, top-k,
   renormalise); with ``--moe-router-pre-softmax`` a softmax over all E then the top-k (Qwen2-MoE without
   ``norm_topk_prob``); or sigmoid scores with DeepSeek-V3's expert bias, groups and scaling factor (see
   :class:`TopKRouter`). It returns ``(probs [T, k], indices [T, k], aux_losses)``; with a capacity factor an
   expert keeps its ``ceil(C·k·T/E)`` most probable assignments and the others are DROPPED: their index
   becomes ``E`` (one past the last expert) and their probability 0.
2. ``dispatcher`` moves the kept (token, expert) pairs into expert order: ``dispatch(hidden [T, h], probs,
   indices) -> (expert_input [N, h], tokens_per_expert [E_local], ctx)`` and back, weighted by the
   probabilities, ``combine(expert_output [N, h], ctx) -> [T, h]``. :class:`LocalDispatcher` is the
   single-process one; expert parallelism (``ptdp.parallel.expert.apply``) swaps in all-to-all / all-gather
   dispatchers from outside and slices ``experts`` to its ranks' experts.
3. ``experts`` (:class:`GroupedExperts`) runs each local expert's MLP on its rows: one grouped GEMM
   (``--moe-grouped-gemm``, ``torch._grouped_mm``) or a loop, both through ``ptdp.ops.grouped`` whose weight
   gradients a zero-bubble W pass can defer.
4. An optional ``shared_expert`` (a dense MLP every token goes through, Qwen2-MoE/DeepSeek) is added,
   optionally scaled by ``sigmoid(x · shared_expert_gate)`` (Qwen2-MoE).

Expert weights are stacked, one tensor per layer whatever the layout: ``experts.fc1_weight [E, g, f, h]``
(g = 2 for SwiGLU: the gate rows, then the up rows, as the dense ``mlp.fc1``; g = 1 for GeLU) and
``experts.fc2_weight [E, h, f]``. The checkpoint holds the global stacked tensor: expert parallelism slices
dim 0, expert tensor parallelism dim 2 (f), and checkpoints reshard across e by logical name. Experts have
no biases (whatever ``--disable-bias-linear``).

Auxiliary losses (load balancing, z-loss) train the router without entering the reported LM loss: the
layer's output carries them into the backward (``ptdp.models.layers.attach_aux_loss``, Megatron's
``MoEAuxLossAutoScaler``),
each with gradient ``aux_loss_scale`` (set by the trainer to the LM loss's own scale: 1/microbatches times
the fp16 loss scale; 1.0 for a plain ``loss.backward()``). The layer also accumulates detached statistics
per training forward (``stats``: the losses, the load per expert, the dropped assignments), read and reset
by the trainer (:func:`pop_moe_stats`) without a host sync.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ptdp.config.validate_moe import moe_layer_pattern
from ptdp.models.layers import AuxiliaryLoss, attach_aux_loss, in_backward, set_aux_loss_scale
from ptdp.ops.grouped import grouped_linear
from ptdp.ops.weight_grad import linear

if TYPE_CHECKING:
    from ptdp.config import ModelConfig, MoEConfig

__all__ = ["GroupedExperts", "LocalDispatcher", "MoELayer", "TopKRouter", "expert_capacity", "moe_layer_pattern",
           "moe_layer_names", "moe_layers", "pop_moe_stats", "set_aux_loss_scale", "update_expert_biases"]


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
        self.bias_update_rate = moe.moe_router_bias_update_rate
        bias = moe.moe_router_enable_expert_bias
        self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32) if bias else None)
        self.register_buffer("tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.int64) if bias else None,
                             persistent=False)

    def forward(self, x: Tensor, num_sequences: int = 1) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """``x [T, h]`` (``num_sequences`` sequences of T/num_sequences tokens, one after the other) →
        ``probs [T, k]`` (fp32), ``indices [T, k]`` (``E`` = dropped), the auxiliary losses (with their
        coefficients; only those enabled)."""
        logits = linear(x, self.weight).float()
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


class GroupedExperts(nn.Module):
    """The E experts' MLPs, weights stacked: ``fc1_weight [E, g, f, h]``, ``fc2_weight [E, h, f]``.

    ``forward(x [N, h] sorted by expert, tokens_per_expert [E_local])``: rows of expert e through
    ``fc2_e(act(fc1_e(x)))``; E_local is read from the weight, so a slice of the experts runs unchanged.
    """

    def __init__(self, cfg: ModelConfig, moe: MoEConfig):
        super().__init__()
        ffn = moe.moe_ffn_hidden_size or cfg.ffn_size
        self.swiglu, self.grouped = cfg.swiglu, moe.moe_grouped_gemm
        self.fc1_weight = nn.Parameter(torch.empty(moe.num_experts, 2 if cfg.swiglu else 1, ffn, cfg.hidden_size))
        self.fc2_weight = nn.Parameter(torch.empty(moe.num_experts, cfg.hidden_size, ffn))

    def forward(self, x: Tensor, tokens_per_expert: Tensor) -> Tensor:
        h = grouped_linear(x, self.fc1_weight, tokens_per_expert, self.grouped)
        if self.swiglu:  # this rank's gate rows, then its up rows (as the dense MLP's fc1)
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return grouped_linear(h, self.fc2_weight, tokens_per_expert, self.grouped)


class LocalDispatcher:
    """Single-process dispatcher: sort the kept (token, expert) pairs by expert (stable: token order within
    an expert), optionally pad each expert's rows to its capacity; combine = weighted scatter-add back."""

    def __init__(self, num_experts: int, topk: int, capacity_factor: float | None = None, pad: bool = False):
        self.num_experts, self.topk = num_experts, topk
        self.capacity_factor, self.pad = capacity_factor, pad and capacity_factor is not None

    def dispatch(self, hidden: Tensor, probs: Tensor, indices: Tensor) -> tuple[Tensor, Tensor, Any]:
        t, e = hidden.shape[0], self.num_experts
        flat = indices.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=e + 1)
        kept = counts[:e]
        # the number of rows kept: all of them without a capacity (no host sync), else a host read of the drops
        n = t * self.topk if self.capacity_factor is None else t * self.topk - int(counts[e])
        order = order[:n]
        tokens = order // self.topk
        weights = probs.flatten()[order]
        rows = hidden[tokens]
        slots = None
        if self.pad:
            capacity = min(expert_capacity(t, self.topk, e, self.capacity_factor), t)
            starts = torch.cumsum(kept, 0) - kept
            expert = flat[order]
            slots = expert * capacity + torch.arange(n, device=hidden.device) - starts[expert]
            rows = hidden.new_zeros(e * capacity, hidden.shape[1]).index_copy(0, slots, rows)
            kept = torch.full_like(kept, capacity)
        return rows, kept, (tokens, weights, slots, t)

    def combine(self, expert_output: Tensor, ctx: Any) -> Tensor:
        tokens, weights, slots, t = ctx
        if slots is not None:
            expert_output = expert_output[slots]
        weighted = expert_output * weights.unsqueeze(-1).to(expert_output.dtype)
        return expert_output.new_zeros(t, expert_output.shape[-1]).index_add(0, tokens, weighted)


class MoELayer(AuxiliaryLoss):
    """``[b, s, h] → [b, s, h]``: router, dispatch, experts, combine (+ the shared expert)."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, shared_expert: nn.Module | None = None):
        super().__init__()
        self.num_experts = moe.num_experts
        self.router = TopKRouter(cfg.hidden_size, moe)
        self.experts = GroupedExperts(cfg, moe)
        self.shared_expert = shared_expert
        self.shared_expert_gate = (nn.Linear(cfg.hidden_size, 1, bias=False)
                                   if shared_expert is not None and moe.moe_shared_expert_gate else None)
        self.dispatcher = LocalDispatcher(moe.num_experts, moe.moe_router_topk, moe.moe_expert_capacity_factor,
                                          moe.moe_pad_expert_input_to_capacity)

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        probs, indices, aux = self.router(flat, num_sequences=b)
        expert_input, tokens_per_expert, ctx = self.dispatcher.dispatch(flat, probs, indices)
        out = self.dispatcher.combine(self.experts(expert_input, tokens_per_expert), ctx)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(linear(flat, self.shared_expert_gate.weight)) * shared
            out = out + shared
        if self.training and not in_backward():
            self._record(aux, indices)
        if aux and self.training and torch.is_grad_enabled():
            out = attach_aux_loss(out, sum(aux.values()), self.aux_loss_scale)
        return out.view(b, s, h)

    @torch.no_grad()
    def _record(self, aux: dict[str, Tensor], indices: Tensor) -> None:
        counts = torch.bincount(indices.flatten(), minlength=self.num_experts + 1).float()
        values = {"load": counts[:-1], "dropped": counts[-1], **{k: v.detach() for k, v in aux.items()}}
        for key, value in values.items():
            self.stats[key] = self.stats[key] + value if key in self.stats else value.clone()


def moe_layer_names(cfg: ModelConfig, moe: MoEConfig) -> list[str]:
    """The logical names of the whole model's MoE layers, in order: ``layers.<i>.mlp`` where
    ``--moe-layer-freq`` says, then the multi-token prediction modules' (MoE when the last layer is)."""
    pattern = moe_layer_pattern(moe.moe_layer_freq, cfg.num_layers) if moe.num_experts else [False] * cfg.num_layers
    names = [f"layers.{i}.mlp" for i, sparse in enumerate(pattern) if sparse]
    mtp = range(cfg.mtp_num_layers or 0) if pattern and pattern[-1] else range(0)
    return names + [f"mtp.layers.{k}.transformer_layer.mlp" for k in mtp]


def moe_layers(modules: list[nn.Module]) -> list[tuple[str, MoELayer]]:
    """Every MoE layer of ``modules`` (model chunks), with its name, in order."""
    return [(name, m) for chunk in modules for name, m in chunk.named_modules() if isinstance(m, MoELayer)]


def pop_moe_stats(modules: list[nn.Module]) -> dict[str, dict[str, Tensor]]:
    """The statistics each MoE layer accumulated since the last call (by layer name), and reset them."""
    out = {}
    for name, layer in moe_layers(modules):
        if layer.stats:
            out[name], layer.stats = layer.stats, {}
    return out


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
