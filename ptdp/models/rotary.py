"""Rotary position embeddings (RoPE, Su et al. 2021) in the rotate-half convention of Megatron and HF.

Each head's first ``rotary_dim = int(head_dim * rotary_percent)`` dimensions are cut into two halves
(x1, x2) and rotated pairwise, dimension ``i`` with ``i + rotary_dim/2``, by the angle ``position ·
inv_freq[i]`` with ``inv_freq[i] = base^(-2i/rotary_dim)``; the remaining dimensions pass unchanged.
(Meta's original checkpoints pair *adjacent* dimensions instead; Hugging Face's converted checkpoints,
which ``ptdp import`` reads, already use rotate-half.)

RoPE needs no parameters and acts per head, so tensor parallelism needs nothing: each rank rotates its
own heads. Attention sees the whole sequence (sequence parallelism gathers it before the QKV GEMM), so
positions are those of the tokens this process holds, as its ``SequencePositions`` module says
(``0 .. s-1``; under context parallelism the real positions of a CP rank's two load-balanced chunks,
swapped in by ``ptdp.parallel.context.apply``). The cos/sin tables are computed in fp32 whatever the model's
dtype (as Megatron and HF do) and cached per (length, device), so a ``--bf16`` cast of the model cannot
touch them.
"""

from __future__ import annotations

import math

import torch

from ptdp.models.documents import DocumentLayout, position_ids
from ptdp.ops.fused import outside_compile

# Llama 3.1's frequency scaling, as published (HF ``rope_type: llama3``; Megatron ``--use-rope-scaling``).
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_CONTEXT = 8192


def inverse_frequencies(rotary_dim: int, base: float, scaling_factor: float | None = None) -> torch.Tensor:
    """``base^(-2i/rotary_dim)`` for i < rotary_dim/2, fp32; with ``scaling_factor`` the llama3 scaling.

    Llama 3.1 keeps high frequencies (wavelength < original context / high factor), divides low ones
    (wavelength > original context / low factor) by the factor, and interpolates smoothly between.
    """
    # on the CPU whatever the device (the model may be built on the meta device): the same table everywhere
    steps = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (base ** (steps / rotary_dim))
    if scaling_factor is None:
        return inv_freq
    low_wavelen = LLAMA3_ORIGINAL_CONTEXT / LLAMA3_LOW_FREQ_FACTOR
    high_wavelen = LLAMA3_ORIGINAL_CONTEXT / LLAMA3_HIGH_FREQ_FACTOR
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling_factor, inv_freq)
    smooth = (LLAMA3_ORIGINAL_CONTEXT / wavelen - LLAMA3_LOW_FREQ_FACTOR) / (
        LLAMA3_HIGH_FREQ_FACTOR - LLAMA3_LOW_FREQ_FACTOR)
    smoothed = (1 - smooth) * scaled / scaling_factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1·mscale·ln(factor) + 1`` (1 when the context is not extended)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inverse_frequencies(rotary_dim: int, base: float, factor: float, original_context: int,
                             beta_fast: float, beta_slow: float, round_to_int: bool = True) -> torch.Tensor:
    """YaRN (Peng et al. 2023), as Megatron-Core's ``YarnRotaryEmbedding`` and HF's ``rope_type: yarn``: the
    frequencies that turn fewer than ``beta_slow`` times over the original context are interpolated
    (divided by ``factor``), those turning more than ``beta_fast`` times kept, a linear ramp between (the
    ramp's ends rounded outwards to whole dimensions, unless ``round_to_int`` is False: GPT-OSS, HF's
    ``truncate: false``)."""
    steps = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float()
    pos_freqs = base ** (steps / rotary_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)

    def dimension(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times
        return rotary_dim * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(beta_fast), dimension(beta_slow)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    ramp = (torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low or 0.001)
    keep = 1 - ramp.clamp(0, 1)  # 1: extrapolate (keep the frequency), 0: interpolate
    return interpolation * (1 - keep) + extrapolation * keep


class RotaryEmbedding:
    """cos/sin tables ``[s, rotary_dim]`` for positions 0..s-1, and their application to q and k.

    Optional: ``inv_freq`` (other frequencies, e.g. YaRN's), ``attention_factor`` (a scale of the tables,
    YaRN's mscale) and ``interleaved``: the rotated pairs are the adjacent dimensions (2i, 2i+1), the layout
    of DeepSeek's checkpoints, which multi-latent attention reads (Megatron-Core and HF de-interleave them
    first, so the output holds the even dimensions, then the odd ones: q and k alike, so qᵀk is unchanged).

    A plain object, not a module: it holds no parameters and no buffers (see the module docstring).
    """

    def __init__(self, head_dim: int, rotary_percent: float, base: float, scaling_factor: float | None = None, *,
                 inv_freq: torch.Tensor | None = None, attention_factor: float = 1.0, interleaved: bool = False):
        self.rotary_dim = int(head_dim * rotary_percent)
        self.inv_freq = inverse_frequencies(self.rotary_dim, base, scaling_factor) if inv_freq is None else inv_freq
        self.attention_factor, self.interleaved = attention_factor, interleaved
        # equal in every layer of a model (they share tables); given frequencies are multi-latent attention's YaRN
        self.key = ("rotary", self.rotary_dim, base, scaling_factor, inv_freq is None, attention_factor)
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, seq_len: int, device: torch.device, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for the ``seq_len`` local tokens at ``positions(seq_len, device)`` (a ``SequencePositions``
        module: it is fixed per model, so it keys the cache)."""
        key = (seq_len, device, positions)
        if key not in self._cache:
            pos = positions(seq_len, device).float()
            freqs = torch.outer(pos, self.inv_freq.to(device))
            angles = torch.cat([freqs, freqs], dim=-1)
            if self.attention_factor != 1.0:
                self._cache[key] = (angles.cos() * self.attention_factor, angles.sin() * self.attention_factor)
            else:
                self._cache[key] = (angles.cos(), angles.sin())
        return self._cache[key]

    @outside_compile  # --compile: built once per microbatch, outside the compiled layers
    def document_tables(self, documents: DocumentLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables ``[b, 1, s, rotary_dim]`` at a packed microbatch's own position ids (restarting in every
        document), built once per microbatch and kept in its layout's cache for the other layers."""
        key = (*self.key, "documents")
        if key not in documents.cache:
            pos = documents.positions.float()
            freqs = pos[..., None] * self.inv_freq.to(pos.device)
            angles = torch.cat([freqs, freqs], dim=-1)[:, None]
            documents.cache[key] = (angles.cos() * self.attention_factor, angles.sin() * self.attention_factor)
        return documents.cache[key]

    def __call__(self, x: torch.Tensor, positions, documents: DocumentLayout | None = None) -> torch.Tensor:
        """Rotate ``x`` of shape ``[b, heads, s, head_dim]`` (any dtype; the tables are cast to it) at the
        positions ``positions`` gives for its s tokens (see :meth:`tables`), or at the position ids of
        ``documents`` when it has its own (``--reset-position-ids``)."""
        if position_ids(documents) is None:
            cos, sin = self.tables(x.shape[-2], x.device, positions)
        else:
            cos, sin = self.document_tables(documents)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        if self.interleaved:
            rot = torch.cat([rot[..., 0::2], rot[..., 1::2]], dim=-1)
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = rot * cos + torch.cat([-x2, x1], dim=-1) * sin
        return torch.cat([rotated, rest], dim=-1) if rest.shape[-1] else rotated
