"""Multi-latent attention (MLA; DeepSeek-V2/V3), one process: ``--multi-latent-attention``.

Queries and keys/values go through low-rank compressions, and the position information through a separate,
decoupled RoPE part (docs/references.md, §DeepSeek-V3). With a heads, per head ``qk_head_dim`` (d_k) query/key
dimensions without positions, ``qk_pos_emb_head_dim`` (d_r) with RoPE, ``v_head_dim`` (d_v):

    q          = q_up_proj(norm(q_down_proj(x)))      [a·(d_k + d_r)]   (``q_proj(x)`` without --q-lora-rank)
    c, k_rope  = kv_down_proj(x)                      [kv_lora_rank], [d_r]: one RoPE key shared by the heads
    k_nope, v  = kv_up_proj(norm(c))                  per head [d_k], [d_v]
    q = [q_nope ; rope(q_rope)],  k = [k_nope ; rope(k_rope)]
    out        = proj(softmax(q kᵀ · scale) v)        [h]

Only c and k_rope would need caching at inference (ptdp trains, so it does not cache). The parameter names
and layouts are those of Megatron-Core and HF's DeepSeek-V3 (per head, the no-RoPE rows then the RoPE rows
of ``q_up_proj``; the key rows then the value rows of ``kv_up_proj``), so a tensor-parallel split of the up
projections' rows by heads is the heads' split. RoPE runs on the interleaved pairs of DeepSeek's checkpoints
(``RotaryEmbedding(interleaved=True)``), with YaRN frequencies and its temperature under ``--rope-type
yarn`` (Megatron-Core's default for MLA): the tables scaled by ``mscale(f, --mscale) / mscale(f,
--mscale-all-dim)``, the softmax scale ``mscale(f, --mscale-all-dim)² / √(d_k + d_r)``.

Like :class:`ptdp.models.gpt.Attention`, the head count is read from the weights, the attention core is a
``CausalAttention`` (context parallelism's seam) behind :meth:`MultiLatentAttention.core` (selective
recomputation's), and the output projection may return its bias for a fused bias-dropout-add.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch import nn

from ptdp.config.validate_moe import rope_type
from ptdp.models.layers import CausalAttention, Linear, RngContext, SequencePositions, norm
from ptdp.models.rotary import RotaryEmbedding, yarn_inverse_frequencies, yarn_mscale

if TYPE_CHECKING:
    from ptdp.config import ModelConfig
    from ptdp.models.documents import DocumentLayout


def mla_rotary(cfg: ModelConfig) -> tuple[RotaryEmbedding, float]:
    """The rotary embedding of the d_r RoPE dimensions and the softmax scale (see the module docstring)."""
    dim, scale = cfg.qk_pos_emb_head_dim, (cfg.qk_head_dim + cfg.qk_pos_emb_head_dim) ** -0.5
    if rope_type(cfg) != "yarn":
        return RotaryEmbedding(dim, 1.0, cfg.rotary_base, interleaved=True), scale
    factor = cfg.rotary_scaling_factor
    inv_freq = yarn_inverse_frequencies(dim, cfg.rotary_base, factor, cfg.original_max_position_embeddings,
                                        cfg.beta_fast, cfg.beta_slow)
    temperature = yarn_mscale(factor, cfg.mscale) / yarn_mscale(factor, cfg.mscale_all_dim)
    all_dim = yarn_mscale(factor, cfg.mscale_all_dim)
    rotary = RotaryEmbedding(dim, 1.0, cfg.rotary_base, inv_freq=inv_freq, attention_factor=temperature,
                             interleaved=True)
    return rotary, scale * all_dim * all_dim


class MultiLatentAttention(nn.Module):
    """``[b, s, h] → [b, s, h]`` causal multi-latent attention (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, positions: SequencePositions, fuse_bias: bool):
        super().__init__()
        h, a = cfg.hidden_size, cfg.num_attention_heads
        self.qk_head_dim, self.rope_dim, self.v_head_dim = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        bias = cfg.add_bias_linear
        q_width = a * (self.qk_head_dim + self.rope_dim)
        self.q_proj: Linear | None = None
        self.q_down_proj: Linear | None = None
        self.q_layernorm: nn.Module | None = None
        self.q_up_proj: Linear | None = None
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(h, q_width, bias=bias)
        else:
            self.q_down_proj = Linear(h, cfg.q_lora_rank, bias=bias)
            self.q_layernorm = norm(cfg, cfg.q_lora_rank)
            self.q_up_proj = Linear(cfg.q_lora_rank, q_width, bias=bias)
        self.kv_down_proj = Linear(h, cfg.kv_lora_rank + self.rope_dim, bias=bias)
        # The shared RoPE key's way to this rank's heads: identity in one process; tensor parallelism swaps in
        # its region (the gradient summed over the ranks' heads; under sequence parallelism an all-gather).
        self.rope_key_region: nn.Module = nn.Identity()
        self.kv_layernorm = norm(cfg, cfg.kv_lora_rank)
        self.kv_up_proj = Linear(cfg.kv_lora_rank, a * (self.qk_head_dim + self.v_head_dim), bias=bias)
        self.proj = Linear(a * self.v_head_dim, h, bias=bias, skip_bias_add=fuse_bias)
        self.rotary, self.softmax_scale = mla_rotary(cfg)
        self.positions = positions
        self.core_attention = CausalAttention()
        self.dropout = cfg.attention_dropout
        self.dropout_rng: RngContext | None = None  # as Attention's: a mask per tensor-parallel rank's heads

    def forward(self, x: torch.Tensor, documents: DocumentLayout | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """The output, or with ``fuse_bias`` the output before its bias and the bias. (Under sequence
        parallelism ``x`` holds s/t tokens; the up projections return all s, the latents stay local.)
        ``documents``: a packed microbatch's positions and attention inside documents, as in ``Attention``."""
        dk, dr = self.qk_head_dim, self.rope_dim
        q = self.q_proj(x) if self.q_proj is not None else self.q_up_proj(self.q_layernorm(self.q_down_proj(x)))
        b, s, _ = q.shape
        q_nope, q_rope = q.view(b, s, -1, dk + dr).transpose(1, 2).split([dk, dr], dim=-1)
        latent, k_rope = self.kv_down_proj(x).split([self.kv_lora_rank, dr], dim=-1)
        kv = self.kv_up_proj(self.kv_layernorm(latent)).view(b, s, -1, dk + self.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([dk, self.v_head_dim], dim=-1)
        q_rope = self.rotary(q_rope, self.positions, documents)
        k_rope = self.rotary(self.rope_key_region(k_rope).unsqueeze(1), self.positions, documents)
        k_rope = k_rope.expand(-1, k_nope.shape[1], -1, -1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        return self.proj(self.core(q, k, v, documents))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             documents: DocumentLayout | None = None) -> torch.Tensor:
        """``[b, heads, s, ·]`` q, k, v → ``[b, s, heads·d_v]``: softmax(q kᵀ · scale) v with dropout.
        Selective recomputation recomputes exactly this."""
        dropout = self.dropout if self.training else 0.0
        rng = self.dropout_rng if dropout > 0.0 and self.dropout_rng is not None else contextlib.nullcontext
        with rng():
            y = self.core_attention(q, k, v, dropout, documents, scale=self.softmax_scale)
        return y.transpose(1, 2).flatten(2)
