"""FLOPs and parameters of Gated DeltaNet layers (``ptdp.models.gated_deltanet``) and of the attention output
gate, for ``ptdp.models.flops`` (training's TFLOP/s) and the planner (``ptdp plan``, ``ptdp simulate``).

A Gated DeltaNet layer's cost is linear in s: per token, with key/value heads nk/nv of widths dk/dv, C the
chunk length (64), ``w = 2·nk·dk + nv·dv`` the convolved channels, its forward multiply-adds are

* projections: ``h·(w + nv·dv)`` (q, k, v, z) + ``h·2·nv`` (β, a) + ``nv·dv·h`` (output);
* the convolution: ``taps·w``;
* the chunked rule, per value head: ``3·dk·dv`` (read the incoming state, correct the new values, write the
  state) + ``C·(2·dk + dv)`` (the chunk's QKᵀ and β·KKᵀ scores, the scores times the new values) +
  ``C·(dk + dv)/2`` (the two unit-triangular solves);

FLOPs are twice that, as everywhere in ``ptdp.models.flops``; the norms, gates and L2 norms are element-wise
and not counted. A full-attention layer with ``--attention-output-gate`` adds its gate projection, ``h·q``.
The layer functions of ``ptdp.models.flops`` take one shape for all layers, so a model mixing both kinds
counts, per layer, the average over its layers of what the mixer kind adds (exact in the totals).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CHUNK = 64  # the chunk length of ``ptdp.models.delta_rule.chunked``


@dataclass(frozen=True)
class LinearShape:
    """The Gated DeltaNet layers of a model: how many of its ``num_layers`` (``layers``), their sizes, and
    whether its full-attention layers have an output gate."""

    layers: int
    num_layers: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    taps: int
    output_gate: bool = False

    @property
    def channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def weights(self, h: int) -> int:
        """Parameters of one Gated DeltaNet layer's mixer (without the layer's input norm)."""
        nv, dv = self.value_heads, self.value_dim
        return h * (self.channels + nv * dv) + h * 2 * nv + self.taps * self.channels + 2 * nv + dv + nv * dv * h

    def macs_per_token(self, h: int) -> int:
        """Forward multiply-adds per token of one Gated DeltaNet layer's mixer (module docstring)."""
        nv, dk, dv = self.value_heads, self.key_dim, self.value_dim
        rule = nv * (3 * dk * dv + CHUNK * (2 * dk + dv) + CHUNK * (dk + dv) // 2)
        return h * (self.channels + nv * dv) + h * 2 * nv + nv * dv * h + self.taps * self.channels + rule

    def average(self, linear: float, gate: float) -> float:
        """Per layer, the average of ``linear`` (what a Gated DeltaNet layer adds over softmax attention) and
        ``gate`` (what a gated full-attention layer adds) over the model's layers."""
        full = self.num_layers - self.layers
        return (self.layers * linear + full * (gate if self.output_gate else 0)) / self.num_layers


def linear_shape(model: Any) -> LinearShape | None:
    """The :class:`LinearShape` of a ``ModelConfig`` (or a planner ``GPTSpec``, which carries one), or None."""
    if hasattr(model, "linear"):
        return model.linear
    gate = bool(getattr(model, "attention_output_gate", False))
    if getattr(model, "experimental_attention_variant", None) != "gated_delta_net":
        return LinearShape(0, model.num_layers, 1, 1, 1, 1, 1, True) if gate else None
    from ptdp.config.validate_linear import linear_attention_layers

    return LinearShape(sum(linear_attention_layers(model)), model.num_layers, model.linear_num_key_heads,
                       model.linear_num_value_heads, model.linear_key_head_dim, model.linear_value_head_dim,
                       model.linear_conv_kernel_dim, gate)


def mixer_flops_delta(linear: LinearShape | None, h: int, q: int, k: int, attended: float, tokens: int) -> int:
    """Forward FLOPs one layer adds (on average) over a softmax-attention layer of widths q, k."""
    if linear is None:
        return 0
    attention = 2 * h * (2 * q + 2 * k) + 4 * attended * q
    return round(tokens * linear.average(2 * linear.macs_per_token(h) - attention, 2 * h * q))


def mixer_parameters_delta(linear: LinearShape | None, h: int, q: int, k: int) -> int:
    """Parameters one layer adds (on average) over a softmax-attention layer of widths q, k (no biases)."""
    if linear is None:
        return 0
    return round(linear.average(linear.weights(h) - h * (2 * q + 2 * k), h * q))
