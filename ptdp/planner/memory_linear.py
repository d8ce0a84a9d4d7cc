"""Activation memory of Gated DeltaNet layers (``ptdp.models.gated_deltanet``) and of the attention output gate,
for the planner's per-layer count (``ptdp.planner.memory.activation_bytes_per_layer``).

What autograd keeps of one Gated DeltaNet mixer per token, at t = 1, key/value heads nk/nv of widths dk/dv,
``w = 2·nk·dk + nv·dv`` convolved channels and C the rule's chunk (64) -- counted from what the layer saves and
checked against a measured layer (tests/planner/test_memory_linear.py):

* at 16 bits: the convolution's input and output (2w), the output projection's input (nv·dv), the decay's
  input (nv);
* in fp32 (the rule and the norms run in fp32 whatever the model's precision): per value head the chunk's
  C-wide score, decay and triangular-system rows (5C), the per-token key-wide and value-wide tensors of the
  chunked form and of the gated norm (9dk + 8dv), a few per-head scalars (8), and the state each chunk starts
  from, ``2·dk·dv/C`` per token; per key head the L2-normalised q and k with their norms (2·(dk + 1)).

Nothing is quadratic in s: C stands where softmax attention has s. Selective recomputation recomputes the
mixer's core (``GatedDeltaNet.core``: the convolution, the rule and the gated norm), which then keeps only
its inputs (the two projections' outputs: w + nv·dv + 2nv) and its output (the output projection's input).
Every term is linear in the head counts, so a tensor-parallel rank keeps 1/t of it.

A full-attention layer with ``--attention-output-gate`` keeps two more q-wide 16-bit tensors per token (the
heads' output before the gate and the gate's sigmoid).
"""

from __future__ import annotations

from ptdp.models.flops_linear import CHUNK, LinearShape


def gdn_bytes_per_token(linear: LinearShape, selective: bool = False) -> float:
    """Activation bytes one Gated DeltaNet mixer keeps per token at t = 1 (module docstring); ``selective``:
    its core recomputed."""
    nk, nv, dk, dv = linear.key_heads, linear.value_heads, linear.key_dim, linear.value_dim
    w = 2 * nk * dk + nv * dv
    if selective:
        return 2 * (w + 2 * nv * dv + 2 * nv)
    half = 2 * (2 * w + nv * dv + nv)
    fp32 = 4 * (nv * (5 * CHUNK + 9 * dk + 8 * dv + 8) + 2 * nk * (dk + 1) + 2 * nv * dk * dv / CHUNK)
    return half + fp32


def mixer_bytes_per_token(linear: LinearShape | None, attention: float, q: int, selective: bool = False) -> float:
    """Per token and layer, on average over the model's layers, what the token mixers keep at t = 1:
    ``attention`` (a softmax-attention layer's bytes per token: its Q, K, V, output-projection input and
    core) where the layer is one, a Gated DeltaNet's own count where it is linear, plus the output gate's
    ``4q`` on gated full-attention layers."""
    if linear is None:
        return attention
    return attention + linear.average(gdn_bytes_per_token(linear, selective) - attention, 4 * q)
