"""Causal self-attention of ``ptdp.models.gpt.GPTModel``'s layers: the QKV projection, the per-head core
(rotary positions, grouped-query attention, the per-head q/k norms of ``--qk-layernorm``, a sliding window
of ``--window-size`` through ``ptdp.models.layers.CausalAttention``, the attention sinks of ``--softmax-type``,
YaRN's rotary tables) and the output projection. Multi-latent
attention is ``ptdp.models.mla``."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch import nn

from ptdp.config.validate_moe import rope_type
from ptdp.models.documents import DocumentLayout
from ptdp.models.layers import CausalAttention, Linear, RngContext, SequencePositions, norm
from ptdp.models.rotary import RotaryEmbedding, yarn_inverse_frequencies, yarn_mscale
from ptdp.models.sinks import AttentionSinks

if TYPE_CHECKING:
    from ptdp.config import ModelConfig


class Attention(nn.Module):
    """Causal self-attention: QKV projection, per-head attention core (rotary positions when on, GQA),
    output projection. The number of heads is read from the QKV weight: a tensor-parallel rank holding a/t
    of them runs this same code. ``window``: this layer's sliding window (``--window-size``; its rotary
    base ``--local-rotary-base``), or None: the whole causal context."""

    def __init__(self, cfg: ModelConfig, positions: SequencePositions, fuse_bias: bool, window: int | None = None):
        super().__init__()
        h, a, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.head_dim = d
        self.grouped = cfg.group_query_attention
        self.heads_per_group = a // cfg.query_groups
        self.dropout = cfg.attention_dropout
        self.dropout_rng: RngContext | None = None  # tensor parallelism: a mask per rank's heads
        base = cfg.local_rotary_base if window is not None and cfg.local_rotary_base else cfg.rotary_base
        self.softmax_scale = cfg.softmax_scale
        self.rotary = rotary_embedding(cfg, base) if cfg.position_embedding_type == "rope" else None
        if cfg.position_embedding_type == "rope" and rope_type(cfg) == "yarn":  # YaRN's softmax temperature
            all_dim = yarn_mscale(cfg.rotary_scaling_factor, cfg.mscale_all_dim)
            if all_dim != 1.0:
                self.softmax_scale = (self.softmax_scale or d ** -0.5) * all_dim * all_dim
        # --softmax-type learnable / off-by-one: one more logit per head in the softmax (ptdp.models.sinks)
        self.sinks = (AttentionSinks(a, cfg.softmax_type == "learnable") if cfg.softmax_type != "vanilla"
                      else None)
        bias = cfg.add_bias_linear
        qkv_bias = bias or cfg.add_qkv_bias
        if self.grouped:  # per group: its a/G query heads, its key head, its value head (Megatron's order)
            self.qkv = Linear(h, (a + 2 * cfg.query_groups) * d, bias=qkv_bias)
        else:  # [3, a·d, h]: all q heads, all k heads, all v heads
            self.qkv = Linear(h, a * d, fused=3, bias=qkv_bias)
        self.positions = positions
        # --qk-layernorm: one norm over the head dimension, shared by every query head (and one by every key
        # head); its gradient sums over the heads (the sharding rules say so: ``GPTModel.sharding_rules``)
        self.q_layernorm = norm(cfg, d) if cfg.qk_layernorm else None
        self.k_layernorm = norm(cfg, d) if cfg.qk_layernorm else None
        self.core_attention = CausalAttention(window, cfg.attn_logit_softcapping)
        # --attention-output-gate (Qwen3-Next): each head's output times sigmoid(x·W_g), W_g [a·d, h] by heads
        self.gate = Linear(h, a * d, bias=False) if cfg.attention_output_gate else None
        self.proj = Linear(a * d, h, bias=bias, skip_bias_add=fuse_bias)

    def forward(self, x: torch.Tensor, documents: DocumentLayout | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """The output, or with ``fuse_bias`` the output before its bias and the bias."""
        return self.proj(self._gated(self.core(self.qkv(x), documents), self.gate, x))

    @staticmethod
    def _gated(y: torch.Tensor, gate, x: torch.Tensor) -> torch.Tensor:
        """The heads' outputs times sigmoid(``gate(x)``) (``--attention-output-gate``); as they are without."""
        return y if gate is None else y * torch.sigmoid(gate(x))

    def core(self, qkv: torch.Tensor, documents: DocumentLayout | None = None) -> torch.Tensor:
        """``[b, s, heads·3·d]`` → ``[b, s, heads·d]``: softmax(QKᵀ/√d) with dropout, times V, per head,
        inside each document of ``documents`` when it masks attention (``ptdp.models.documents``).
        Selective recomputation recomputes exactly this (it holds the a·s² activations, few FLOPs)."""
        b, s, _ = qkv.shape
        d = self.head_dim
        if self.grouped:
            groups = qkv.view(b, s, -1, self.heads_per_group + 2, d)
            q = groups[:, :, :, :-2].reshape(b, s, -1, d).transpose(1, 2)
            k, v = groups[:, :, :, -2].transpose(1, 2), groups[:, :, :, -1].transpose(1, 2)
        else:
            q, k, v = qkv.view(b, s, 3, -1, d).permute(2, 0, 3, 1, 4)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if self.rotary is not None:
            q, k = self.rotary(q, self.positions, documents), self.rotary(k, self.positions, documents)
        if self.grouped and self.heads_per_group > 1:  # query head j attends with key/value group j // (a/G)
            k, v = k.repeat_interleave(self.heads_per_group, 1), v.repeat_interleave(self.heads_per_group, 1)
        dropout = self.dropout if self.training else 0.0
        # Without dropout no RNG stream is switched: swapping generator states would split a compiled layer
        # into pieces (graph breaks).
        rng = self.dropout_rng if dropout > 0.0 and self.dropout_rng is not None else contextlib.nullcontext
        with rng():
            sinks = None if self.sinks is None else self.sinks(q)
            y = self.core_attention(q, k, v, dropout, documents, scale=self.softmax_scale, sinks=sinks)
        return y.transpose(1, 2).reshape(b, s, -1)


def rotary_embedding(cfg: ModelConfig, base: float) -> RotaryEmbedding:
    """The rotary embedding of one layer at rotary base ``base``: plain, Llama 3.1's scaling
    (``--use-rope-scaling``) or YaRN (``--rope-type yarn``: GPT-OSS; the tables times mscale(f, --mscale) /
    mscale(f, --mscale-all-dim), the correction range unrounded with
    ``--no-yarn-correction-range-round-to-int``)."""
    d = cfg.head_dim
    if rope_type(cfg) != "yarn":
        return RotaryEmbedding(d, cfg.rotary_percent, base, cfg.rope_scaling_factor if cfg.use_rope_scaling else None)
    factor, dim = cfg.rotary_scaling_factor, int(d * cfg.rotary_percent)
    inv_freq = yarn_inverse_frequencies(dim, base, factor, cfg.original_max_position_embeddings, cfg.beta_fast,
                                        cfg.beta_slow, round_to_int=cfg.yarn_correction_range_round_to_int)
    temperature = yarn_mscale(factor, cfg.mscale) / yarn_mscale(factor, cfg.mscale_all_dim)
    return RotaryEmbedding(d, cfg.rotary_percent, base, inv_freq=inv_freq, attention_factor=temperature)
