"""Multi-token prediction (MTP; DeepSeek-V3, Megatron-Core's ``--mtp-num-layers``), one process.

D sequential modules after the model. With ``h⁰`` the model's final hidden states (after its final norm)
and t the tokens, module k = 1..D at position i combines ``RMSNorm(h^{k-1}_i)`` with ``RMSNorm(Emb(t_{i+k}))``
through a linear projection of their concatenation (embedding first), runs one transformer layer and its own
final norm, and predicts ``t_{i+k+1}`` with the model's output layer:

    h^k = final_layernorm_k(layer_k(eh_proj_k([embedding_layernorm_k(Emb(t_{·+k})) ; hidden_layernorm_k(h^{k-1})])))
    loss_MTP = λ · mean_k CE_k,   CE_k the mean over the b·(s-k) positions whose target t_{i+k+1} exists

(docs/references.md, §DeepSeek-V3; λ = ``--mtp-loss-scaling-factor``). The embedding and the output layer are
the model's own (shared). The tokens are read from the labels, ``labels_i = t_{i+1}``, so that the module
needs only what the loss already has: module k's targets are ``labels`` shifted left by k places, its
tokens ``labels`` shifted by k-1 places, token 0 where the target does not exist (Megatron-Core rolls the
input ids; it fills the same places, which causal attention keeps from the others). The shift is a seam,
:class:`ShiftLabels`: context parallelism swaps in one that moves the labels across its ranks' chunks,
and its mean over the positions whose target exists is the rank's share of the global one.

The loss trains without entering the reported LM loss: it is attached to the backward of the hidden
states the output layer reads (``attach_aux_loss``, Megatron's ``MTPLossAutoScaler``) with the LM loss's weight ``aux_loss_scale``, and
``stats["mtp_losses"]`` accumulates each module's CE (detached) for the ``mtp_loss`` metric.

Separable pieces for the parallelisms applied from outside: :meth:`MultiTokenPrediction.hidden_states`
(the D modules, for the last pipeline stage) and :meth:`MultiTokenPrediction.losses` (one output-layer
projection and cross-entropy per module through the ``head`` and ``cross_entropy`` seams, which vocabulary
parallelism can spread over the pipeline stages).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ptdp.models.layers import AuxiliaryLoss, CrossEntropy, Linear, attach_aux_loss, in_backward, norm

if TYPE_CHECKING:
    from ptdp.config import ModelConfig


class MTPLayer(nn.Module):
    """One MTP module: the two norms, ``eh_proj [h, 2h]``, a transformer layer and a final norm."""

    def __init__(self, cfg: ModelConfig, transformer_layer: nn.Module):
        super().__init__()
        h = cfg.hidden_size
        self.embedding_layernorm = norm(cfg)
        self.hidden_layernorm = norm(cfg)
        self.eh_proj = Linear(2 * h, h, bias=False)
        self.transformer_layer = transformer_layer
        self.final_layernorm = norm(cfg)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.embedding_layernorm(embedded), self.hidden_layernorm(hidden)], dim=-1))
        return self.final_layernorm(self.transformer_layer(x))


class ShiftLabels(nn.Module):
    """``labels [b, s]`` moved ``places`` to the left in sequence order, the emptied places -1 (no token),
    and the mean over a module's positions whose target exists."""

    def forward(self, labels: torch.Tensor, places: int) -> torch.Tensor:
        if places == 0:
            return labels
        return torch.cat([labels[:, places:], labels.new_full((labels.shape[0], places), -1)], dim=1)

    def mean(self, values: torch.Tensor, places: int) -> torch.Tensor:
        """``values [b, s]`` (zero where the target is gone) summed over the b·(s - places) positions whose
        target exists, divided by their number."""
        b, s = values.shape
        return values.sum() / (b * (s - places))


class MultiTokenPrediction(AuxiliaryLoss):
    """The D MTP modules (``layers``, keyed "0".."D-1"), their loss and its statistics."""

    def __init__(self, cfg: ModelConfig, transformer_layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict({str(k): MTPLayer(cfg, layer) for k, layer in enumerate(transformer_layers)})
        self.scaling_factor = cfg.mtp_loss_scaling_factor
        self.cross_entropy = CrossEntropy()
        self.shift = ShiftLabels()

    def hidden_states(self, hidden: torch.Tensor, labels: torch.Tensor,
                      embed: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        """``h¹ .. h^D`` from the model's final hidden states ``h⁰`` and the labels (the tokens t_{i+1})."""
        out = []
        for k, layer in enumerate(self.layers.values(), start=1):  # module k reads t_{i+k} = labels_{i+k-1}
            gone = self.shift(labels, k) < 0
            tokens = self.shift(labels, k - 1).masked_fill(gone, 0)  # Megatron-Core's zero-filled rolled ids
            hidden = layer(hidden, embed(tokens))
            out.append(hidden)
        return out

    def losses(self, hiddens: list[torch.Tensor], labels: torch.Tensor,
               head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``[D]``: module k's mean cross-entropy over the positions whose target ``labels_{i+k}`` exists."""
        out = []
        for k, hidden in enumerate(hiddens, start=1):  # module k predicts t_{i+k+1} = labels_{i+k}
            target = self.shift(labels, k)
            losses = self.cross_entropy(head(hidden), target.clamp(min=0)).masked_fill(target < 0, 0.0)
            out.append(self.shift.mean(losses, k))
        return torch.stack(out)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor, embed: Callable[[torch.Tensor], torch.Tensor],
                head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``hidden`` (the model's final hidden states, on their way to its output layer), carrying
        ``λ · mean_k CE_k`` into the backward."""
        losses = self.losses(self.hidden_states(hidden, labels, embed), labels, head)
        if self.training and not in_backward():
            value = losses.detach()
            self.stats["mtp_losses"] = self.stats["mtp_losses"] + value if "mtp_losses" in self.stats else value
        if self.training and torch.is_grad_enabled():
            hidden = attach_aux_loss(hidden, self.scaling_factor * losses.mean(), self.aux_loss_scale)
        return hidden


def pop_mtp_losses(modules: list[nn.Module]) -> torch.Tensor | None:
    """The ``[D]`` sums of the MTP modules' cross-entropies since the last call (None: no MTP here)."""
    for chunk in modules:
        for module in chunk.modules():
            if isinstance(module, MultiTokenPrediction) and module.stats:
                return module.stats.pop("mtp_losses")
    return None
