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
   probabilities, ``combine(expert_output [N, h], ctx) -> [T, h]``, each cut at its communication
   (:class:`Dispatcher`). :class:`LocalDispatcher` is the single-process one; expert parallelism
   (``ptdp.parallel.expert.apply``) swaps in all-to-all / all-gather dispatchers from outside and slices
   ``experts`` to its ranks' experts.

The layer is also a program of pieces (:meth:`MoELayer.steps`, ``ptdp.models.pieces``): route, dispatch,
experts, combine, finish, with the dispatcher's communication between them outside autograd. Its
``forward`` runs that program at once; DualPipe's overlapped forward-and-backward runs it a piece at a
time, interleaved with another microbatch's backward (``ptdp.parallel.pipeline.overlap``).
3. ``experts`` (:class:`GroupedExperts`) runs each local expert's MLP on its rows: one grouped GEMM
   (``--moe-grouped-gemm``, ``torch._grouped_mm``) or a loop, both through ``ptdp.ops.grouped`` whose weight
   gradients a zero-bubble W pass can defer.
4. An optional ``shared_expert`` (a dense MLP every token goes through, Qwen2-MoE/DeepSeek) is added,
   optionally scaled by ``sigmoid(x · shared_expert_gate)`` (Qwen2-MoE).

Expert weights are stacked, one tensor per layer whatever the layout: ``experts.fc1_weight [E, g, f, h]``
(g = 2 for SwiGLU: the gate rows, then the up rows, as the dense ``mlp.fc1``; g = 1 for GeLU) and
``experts.fc2_weight [E, h, f]``. The checkpoint holds the global stacked tensor: expert parallelism slices
dim 0, expert tensor parallelism dim 2 (f), and checkpoints reshard across e by logical name. Experts have
no biases (whatever ``--disable-bias-linear``) unless ``--moe-linear-bias`` gives them one (GPT-OSS), the router's
logits one too.

Auxiliary losses (load balancing, z-loss) train the router without entering the reported LM loss: the
layer's output carries them into the backward (``ptdp.models.layers.attach_aux_loss``, Megatron's
``MoEAuxLossAutoScaler``),
each with gradient ``aux_loss_scale`` (set by the trainer to the LM loss's own scale: 1/microbatches times
the fp16 loss scale; 1.0 for a plain ``loss.backward()``). The layer also accumulates detached statistics
per training forward (``stats``: the losses, the load per expert, the dropped assignments), read and reset
by the trainer (:func:`pop_moe_stats`) without a host sync.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ptdp.config.validate_moe import moe_layer_pattern
from ptdp.models.glu import gated_activation
from ptdp.models.layers import AuxiliaryLoss, attach_aux_loss, in_backward, set_aux_loss_scale
from ptdp.models.pieces import Compute, Done, Exchange, Step, Transfer, exchanged, run_sequential
from ptdp.models.router import TopKRouter, expert_capacity, update_expert_biases
from ptdp.ops.grouped import grouped_linear
from ptdp.ops.weight_grad import linear

if TYPE_CHECKING:
    from ptdp.config import ModelConfig, MoEConfig

__all__ = ["Dispatcher", "GroupedExperts", "Local", "LocalDispatcher", "MoELayer", "TopKRouter", "expert_capacity",
           "moe_layer_names", "moe_layer_pattern", "moe_layers", "pop_moe_stats", "set_aux_loss_scale",
           "update_expert_biases"]


class GroupedExperts(nn.Module):
    """The E experts' MLPs, weights stacked: ``fc1_weight [E, g, f, h]``, ``fc2_weight [E, h, f]``; with
    ``--moe-linear-bias`` also ``fc1_bias [E, g, f]`` and ``fc2_bias [E, h]`` (GPT-OSS).

    ``forward(x [N, h] sorted by expert, tokens_per_expert [E_local])``: rows of expert e through
    ``fc2_e(act(fc1_e(x)))``; E_local is read from the weight, so a slice of the experts runs unchanged. The
    gated activation (SwiGLU, GeGLU, GPT-OSS's clamped quick-GeGLU) is the dense MLP's (``ptdp.models.glu``).
    """

    def __init__(self, cfg: ModelConfig, moe: MoEConfig):
        super().__init__()
        ffn = moe.moe_ffn_hidden_size or cfg.ffn_size
        self.glu, self.grouped = gated_activation(cfg), moe.moe_grouped_gemm
        self.approximate = cfg.gelu_approximate  # the dense MLP's GeLU form (tanh or exact)
        g = 2 if cfg.gated_mlp else 1
        self.fc1_weight = nn.Parameter(torch.empty(moe.num_experts, g, ffn, cfg.hidden_size))
        self.fc2_weight = nn.Parameter(torch.empty(moe.num_experts, cfg.hidden_size, ffn))
        bias = moe.moe_linear_bias
        self.fc1_bias = nn.Parameter(torch.zeros(moe.num_experts, g, ffn)) if bias else None
        self.fc2_bias = nn.Parameter(torch.zeros(moe.num_experts, cfg.hidden_size)) if bias else None
        # LoRA adapters of the stacked experts (``ptdp.parallel.lora``), called like the weights: (x, counts)
        self.fc1_adapter: nn.Module | None = None
        self.fc2_adapter: nn.Module | None = None

    def forward(self, x: Tensor, tokens_per_expert: Tensor) -> Tensor:
        h = _add_bias(grouped_linear(x, self.fc1_weight, tokens_per_expert, self.grouped), self.fc1_bias,
                      tokens_per_expert)
        if self.fc1_adapter is not None:
            h = h + self.fc1_adapter(x, tokens_per_expert)
        # this rank's gate rows, then its up rows (as the dense MLP's fc1)
        h = self.glu(h) if self.glu is not None else F.gelu(h, approximate=self.approximate)
        y = _add_bias(grouped_linear(h, self.fc2_weight, tokens_per_expert, self.grouped), self.fc2_bias,
                      tokens_per_expert)
        return y if self.fc2_adapter is None else y + self.fc2_adapter(h, tokens_per_expert)


def _add_bias(y: Tensor, bias: Tensor | None, tokens_per_expert: Tensor) -> Tensor:
    """``y [N, ...]`` (rows sorted by expert) plus each row's expert's bias (``bias [E_local, ...]``)."""
    if bias is None:
        return y
    rows = torch.repeat_interleave(bias.flatten(1), tokens_per_expert, dim=0, output_size=y.shape[0])
    return y + rows.to(y.dtype)


class Dispatcher:
    """The token dispatcher seam: a dispatch and a combine, each cut at its communication so that the
    pieces of ``ptdp.models.pieces`` can run it (``MoELayer.steps``)::

        prepare(hidden [T, h], probs [T, k], indices [T, k]) -> (send, keep, ctx)
        dispatch_transfer(ctx): send -> received                     (communication, outside autograd)
        arrive(received, ctx) -> (expert_input [N, h], tokens_per_expert [E_local], carry)
        depart(expert_output [N, h], carry, ctx) -> back
        combine_transfer(ctx): back -> returned                       (communication)
        finish(returned, keep, ctx) -> [T, h]     # Σ_k probs · expert output, per token

    ``send``, ``keep``, ``carry``, ``back`` and ``returned`` are tuples of tensors (those that carry
    gradients pass between the pieces as values); ``ctx`` holds only what carries none (orders, counts).
    :meth:`dispatch` and :meth:`combine` compose them with autograd through the transfers.
    """

    def dispatch(self, hidden: Tensor, probs: Tensor, indices: Tensor) -> tuple[Tensor, Tensor, Any]:
        send, keep, ctx = self.prepare(hidden, probs, indices)
        expert_input, tokens_per_expert, carry = self.arrive(exchanged(self.dispatch_transfer(ctx), send), ctx)
        return expert_input, tokens_per_expert, (keep, carry, ctx)

    def combine(self, expert_output: Tensor, state: Any) -> Tensor:
        keep, carry, ctx = state
        back = self.depart(expert_output, carry, ctx)
        return self.finish(exchanged(self.combine_transfer(ctx), back), keep, ctx)

    def dispatch_transfer(self, ctx: Any) -> Transfer:
        return Local()

    def combine_transfer(self, ctx: Any) -> Transfer:
        return Local()


class Local:
    """The transfer of one process: the tensors stay where they are."""

    def start(self, tensors: tuple) -> Done:
        return Done(tensors)

    def start_backward(self, grads: tuple) -> Done:
        return Done(grads)


class LocalDispatcher(Dispatcher):
    """Single-process dispatcher: sort the kept (token, expert) pairs by expert (stable: token order within
    an expert), optionally pad each expert's rows to its capacity; combine = weighted scatter-add back."""

    def __init__(self, num_experts: int, topk: int, capacity_factor: float | None = None, pad: bool = False):
        self.num_experts, self.topk = num_experts, topk
        self.capacity_factor, self.pad = capacity_factor, pad and capacity_factor is not None

    def prepare(self, hidden: Tensor, probs: Tensor, indices: Tensor) -> tuple[tuple, tuple, Any]:
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
        return (rows,), (weights,), (tokens, slots, t, kept)

    def arrive(self, received: tuple, ctx: Any) -> tuple[Tensor, Tensor, tuple]:
        return received[0], ctx[3], ()

    def depart(self, expert_output: Tensor, carry: tuple, ctx: Any) -> tuple:
        return (expert_output,)

    def finish(self, returned: tuple, keep: tuple, ctx: Any) -> Tensor:
        tokens, slots, t, _ = ctx
        (expert_output,), (weights,) = returned, keep
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
        return run_sequential(self.steps("x", "y"), {"x": x})["y"]

    def steps(self, inp: str, out: str) -> list[Step]:
        """The layer as pieces (``ptdp.models.pieces``) from the value ``inp`` ``[b, s, h]`` to ``out``: route
        (router, shared expert, the dispatcher's ``prepare``), the dispatch transfer, the experts (between
        the dispatcher's ``arrive`` and ``depart``), the combine transfer, then ``finish``."""
        name = functools.partial("{}.{}".format, out)
        return [
            Compute(self._route, (inp,), (name("send"), name("keep"), name("ctx")), "moe_route"),
            Exchange(lambda v: self.dispatcher.dispatch_transfer(v[name("ctx")][1]), name("send"), name("recv"),
                     "moe_dispatch"),
            Compute(self._experts, (name("recv"), name("ctx")), (name("back"),), "moe_experts"),
            Exchange(lambda v: self.dispatcher.combine_transfer(v[name("ctx")][1]), name("back"),
                     name("returned"), "moe_combine"),
            Compute(self._finish, (name("returned"), name("keep"), name("ctx")), (out,), "moe_finish"),
        ]

    def _route(self, x: Tensor) -> tuple[tuple, tuple, tuple]:
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        probs, indices, aux = self.router(flat, num_sequences=b)
        if self.training and not in_backward():
            self._record(aux, indices)
        shared = None
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(linear(flat, self.shared_expert_gate.weight)) * shared
        aux_loss = sum(aux.values()) if aux and self.training and torch.is_grad_enabled() else None
        send, keep, ctx = self.dispatcher.prepare(flat, probs, indices)
        return send, (aux_loss, shared, *keep), ((b, s, h), ctx)

    def _experts(self, received: tuple, ctx: tuple) -> tuple[tuple]:
        expert_input, tokens_per_expert, carry = self.dispatcher.arrive(received, ctx[1])
        return (self.dispatcher.depart(self.experts(expert_input, tokens_per_expert), carry, ctx[1]),)

    def _finish(self, returned: tuple, keep: tuple, ctx: tuple) -> tuple[Tensor]:
        aux_loss, shared, *kept = keep
        out = self.dispatcher.finish(returned, tuple(kept), ctx[1])
        if shared is not None:
            out = out + shared
        if aux_loss is not None:
            out = attach_aux_loss(out, aux_loss, self.aux_loss_scale)
        return (out.view(ctx[0]),)

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
