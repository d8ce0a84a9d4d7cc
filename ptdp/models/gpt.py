"""The GPT model (Megatron's GPT = the GPT-2 architecture) and its Llama options, for one process.

Read it top to bottom like nanoGPT: learned position embeddings, pre-LayerNorm blocks of causal
self-attention and a GeLU MLP of ``ffn_hidden_size`` (4h), a final LayerNorm and logits tied to the input
embedding. Biases can be returned by the linears and fused into the next element-wise op (``ptdp.ops.fused``,
with ``--compile``).

The Llama family is the same model with five options (Megatron's flags, ``ModelConfig``): rotary instead
of learned positions (``rotary.py``), RMSNorm instead of LayerNorm, a SwiGLU MLP whose gate and up
projections are one weight ``[2, ffn, h]``, grouped-query attention (G key/value heads; the QKV weight is
``[(a + 2G)·d, h]`` in Megatron's order, per group its a/G query heads then its key and its value head),
and no linear biases with an output layer ``lm_head`` untied from the embedding.

The model knows nothing of parallelism (``docs/architecture.md``). Parallelisms transform it from outside:
tensor parallelism swaps its blocks for split ones (attention reads its head count from the QKV weight, so
a rank's share needs no edit here); context parallelism swaps its positions and attention core; pipeline
splitting keeps only some of its parts, which is why each part runs only when present (``embedding``,
``final_layernorm`` may be None) and ``layers`` is keyed by the GLOBAL layer index: parameter names are the
full model's (``layers.7.mlp.fc1.weight`` is layer 7 wherever it lives), so checkpoints do not depend on the
layout; recomputation overrides :meth:`GPTModel.run_layers` and :meth:`Attention.core`.

:meth:`GPTModel.program` is the same forward as pieces with explicit boundaries (``ptdp.models.pieces``):
what DualPipe's overlapped forward-and-backward interleaves with another microbatch's backward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ptdp.models.documents import DocumentLayout, position_ids
from ptdp.models.gpt_sharding import gpt_sharding_rules
from ptdp.models.layers import (
    CausalAttention,
    DropoutAdd,
    Linear,
    Logits,
    RngContext,
    SequencePositions,
    norm,
)
from ptdp.models.mla import MultiLatentAttention
from ptdp.models.moe import MoELayer, moe_layer_pattern
from ptdp.models.mtp import MultiTokenPrediction
from ptdp.models.parts import PipelineParts
from ptdp.models.pieces import Compute, Exchange, Step, Transfer
from ptdp.models.rotary import RotaryEmbedding
from ptdp.models.sharding import ShardingRules
from ptdp.ops.fused import EAGER, FusedOps, fused_ops

if TYPE_CHECKING:
    from ptdp.config import ModelConfig, MoEConfig

# How the pipeline cuts a GPTModel (``ptdp.models.parts``): the attribute names of ``GPTModel.__init__``.
PIPELINE_PARTS = PipelineParts(
    layers="layers", first=("embedding",), last=("final_layernorm", "lm_head", "mtp"), input_embedding="embedding",
    table="word_embeddings", final_norm="final_layernorm", untied_output="lm_head", to_logits="logits",
    multi_token_prediction="mtp", head_copy="output_layer", mtp_copy="embedding_copy")
TIED_EMBEDDING = PIPELINE_PARTS.table_weight  # the input embedding, also the output weight when tied


class Attention(nn.Module):
    """Causal self-attention: QKV projection, per-head attention core (rotary positions when on, GQA),
    output projection. The number of heads is read from the QKV weight: a tensor-parallel rank holding a/t
    of them runs this same code."""

    def __init__(self, cfg: ModelConfig, positions: SequencePositions, fuse_bias: bool):
        super().__init__()
        h, a, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.head_dim = d
        self.grouped = cfg.group_query_attention
        self.heads_per_group = a // cfg.query_groups
        self.dropout = cfg.attention_dropout
        self.dropout_rng: RngContext | None = None  # tensor parallelism: a mask per rank's heads
        self.rotary = (RotaryEmbedding(d, cfg.rotary_percent, cfg.rotary_base,
                                       cfg.rope_scaling_factor if cfg.use_rope_scaling else None)
                       if cfg.position_embedding_type == "rope" else None)
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
        self.core_attention = CausalAttention()
        self.proj = Linear(a * d, h, bias=bias, skip_bias_add=fuse_bias)

    def forward(self, x: torch.Tensor, documents: DocumentLayout | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """The output, or with ``fuse_bias`` the output before its bias and the bias."""
        return self.proj(self.core(self.qkv(x), documents))

    def local(self, x: torch.Tensor, documents: DocumentLayout | None = None) -> torch.Tensor | tuple:
        """:meth:`forward` between the QKV projection's entry and the output projection's exit (``Linear``'s
        communication seam): what one piece of ``TransformerLayer.steps`` computes."""
        return self.proj.local(self.core(self.qkv.local(x), documents))

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
            y = self.core_attention(q, k, v, dropout, documents)
        return y.transpose(1, 2).reshape(b, s, -1)


class MLP(nn.Module):
    """GeLU MLP fc2(gelu(fc1(x))), or with ``--swiglu`` fc2(silu(gate(x)) * up(x)) where fc1 = [gate; up]."""

    def __init__(self, cfg: ModelConfig, ops: FusedOps):
        super().__init__()
        self.swiglu = cfg.swiglu
        # Eagerly, the bias is cheapest inside the GEMM (addmm); compiled, it fuses with the GeLU.
        self.fuse = ops.compiled and not cfg.swiglu and cfg.add_bias_linear
        self.fc1 = Linear(cfg.hidden_size, cfg.ffn_size, fused=2 if cfg.swiglu else 1, bias=cfg.add_bias_linear,
                          skip_bias_add=self.fuse)
        self.fc2 = Linear(cfg.ffn_size, cfg.hidden_size, bias=cfg.add_bias_linear, skip_bias_add=ops.compiled)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """The output, or (compiled ops) the output before its bias and the bias."""
        return self._run(x, self.fc1, self.fc2)

    def local(self, x: torch.Tensor) -> torch.Tensor | tuple:
        """:meth:`forward` between fc1's entry and fc2's exit (``Linear``'s communication seam)."""
        return self._run(x, self.fc1.local, self.fc2.local)

    def _run(self, x: torch.Tensor, fc1: Callable, fc2: Callable) -> torch.Tensor | tuple:
        if self.swiglu:  # the gate rows, then the up rows (fc1's weight is [2, ffn, h])
            gate, up = fc1(x).chunk(2, dim=-1)
            return fc2(F.silu(gate) * up)
        h = self.ops.bias_gelu(*fc1(x)) if self.fuse else F.gelu(fc1(x), approximate="tanh")
        return fc2(h)


def moe_mlp(cfg: ModelConfig, moe: MoEConfig) -> MoELayer:
    """The MoE layer that replaces the MLP (``ptdp.models.moe``), with its shared expert if any."""
    shared = None
    if moe.moe_shared_expert_intermediate_size:
        shared = MLP(dataclasses.replace(cfg, ffn_hidden_size=moe.moe_shared_expert_intermediate_size), EAGER)
    return MoELayer(cfg, moe, shared)


class TransformerLayer(nn.Module):
    """Pre-LayerNorm block: x + drop(attn(ln(x)) + bias), then x + drop(mlp(ln(x)) + bias); with ``moe``
    the MLP is a mixture of experts, with ``--multi-latent-attention`` the attention is MLA (``mla.py``)."""

    def __init__(self, cfg: ModelConfig, ops: FusedOps, positions: SequencePositions, moe: MoEConfig | None = None):
        super().__init__()
        self.input_layernorm = norm(cfg)
        attention = MultiLatentAttention if cfg.multi_latent_attention else Attention
        self.attention = attention(cfg, positions, fuse_bias=ops.compiled)
        self.post_attention_layernorm = norm(cfg)
        self.mlp = moe_mlp(cfg, moe) if moe is not None else MLP(cfg, ops)
        self.dropout_add = DropoutAdd(cfg.hidden_dropout, ops)

    def forward(self, x: torch.Tensor, documents: DocumentLayout | None = None) -> torch.Tensor:
        return self.mlp_half(self.attention_half(x, documents))

    def attention_half(self, x: torch.Tensor, documents: DocumentLayout | None = None) -> torch.Tensor:
        return self.dropout_add(self.attention(self.input_layernorm(x), documents), x)

    def mlp_half(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout_add(self.mlp(self.post_attention_layernorm(x)), x)

    def steps(self, inp: str, out: str, documents: DocumentLayout | None = None) -> list[Step]:
        """The layer as pieces (``ptdp.models.pieces``) from value ``inp`` to ``out``: its two halves, or with a
        MoE the attention half (and the norm before the router), the MoE layer's pieces, the residual.

        A half whose linears communicate (``Linear.entry`` / ``exit``: a parallelism split them) is cut
        there: norm, the entry exchange, the GEMMs between (attention, or the MLP), the exit exchange, the
        bias and residual -- so that the communication runs under another microbatch's piece."""
        name = functools.partial("{}.{}".format, out)
        moe = isinstance(self.mlp, MoELayer)
        attention = self._attention_steps(inp, name, documents, moe)
        if moe:
            return [*attention, *self.mlp.steps(name("h"), name("moe")),
                    Compute(lambda y, x: (self.dropout_add(y, x),), (name("moe"), name("x1")), (out,), "residual")]
        cut = _cut(self.mlp.fc1, self.mlp.fc2) if isinstance(self.mlp, MLP) else None
        if cut is None:
            return [*attention, Compute(lambda x: (self.mlp_half(x),), (name("x1"),), (out,), "mlp")]
        return [*attention, *_cut_half(self.post_attention_layernorm, self.mlp.local, self.mlp.fc2.after,
                                       lambda y, x: (self.dropout_add(y, x),), cut, name("x1"), (out,), "mlp")]

    def _attention_steps(self, inp: str, name: Callable[[str], str], documents: DocumentLayout | None,
                         norm: bool) -> list[Step]:
        """The attention half from ``inp`` to ``name("x1")`` (with ``norm`` also the MLP's norm of it,
        ``name("h")``, the router's input)."""
        outputs = (name("x1"), name("h")) if norm else (name("x1"),)

        def residual(out: torch.Tensor | tuple, x: torch.Tensor) -> tuple:
            x1 = self.dropout_add(out, x)
            return (x1, self.post_attention_layernorm(x1)) if norm else (x1,)

        cut = _cut(self.attention.qkv, self.attention.proj) if isinstance(self.attention, Attention) else None
        if cut is None:
            return [Compute(lambda x: residual(self.attention(self.input_layernorm(x), documents), x), (inp,),
                            outputs, "attention")]
        return _cut_half(self.input_layernorm, functools.partial(self.attention.local, documents=documents),
                         self.attention.proj.after, residual, cut, inp, outputs, "attention")


def _cut(first: nn.Module, last: nn.Module) -> tuple[Transfer, Transfer] | None:
    """The entry of a half's first linear and the exit of its last, where both communicate; else None."""
    entry, exit = first.entry(), last.exit()
    return None if entry is None or exit is None else (entry, exit)


def _cut_half(norm: nn.Module, local: Callable, after: Callable, residual: Callable,
              cut: tuple[Transfer, Transfer], inp: str, outputs: tuple[str, ...], what: str) -> list[Step]:
    """A half ``residual(after(exit(local(entry(norm(x))))), x)`` from ``inp`` to ``outputs``, as pieces cut
    at its entry and exit (``TransformerLayer.steps``)."""
    entry, exit = cut
    n = functools.partial("{}.{}.{}".format, outputs[0], what)
    return [Compute(lambda x: ((norm(x),),), (inp,), (n("norm"),), f"{what}_norm"),
            Exchange(lambda _: entry, n("norm"), n("in"), f"{what}_in"),
            Compute(lambda t: ((local(t[0]),),), (n("in"),), (n("local"),), what),
            Exchange(lambda _: exit, n("local"), n("out"), f"{what}_out"),
            Compute(lambda t, x: residual(after(t[0]), x), (n("out"), inp), outputs, f"{what}_residual")]


class Embedding(nn.Module):
    """Token embeddings plus (GPT-2) learned position embeddings, then dropout."""

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int, positions: SequencePositions):
        super().__init__()
        self.word_embeddings = nn.Embedding(padded_vocab_size, cfg.hidden_size)
        self.position_embeddings = (nn.Embedding(cfg.max_position_embeddings or cfg.seq_length, cfg.hidden_size)
                                    if cfg.position_embedding_type == "learned_absolute" else None)  # else RoPE
        self.positions = positions
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, tokens: torch.Tensor, documents: DocumentLayout | None = None) -> torch.Tensor:
        x = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            ids = position_ids(documents)  # --reset-position-ids: [b, s], restarting in every document
            x = x + self.position_embeddings(self.positions(tokens.shape[1], tokens.device) if ids is None else ids)
        return self.dropout(x)


class GPTModel(nn.Module):
    """Token ids ``[b, s]`` in, logits ``[b, s, padded V]`` out (padding columns -inf). With ``moe`` (and
    ``moe.num_experts``) the layers ``--moe-layer-freq`` picks hold a mixture of experts. With
    ``--mtp-num-layers D``, ``mtp`` holds the multi-token prediction modules (``mtp.py``; their transformer
    layers like the last one), whose loss a training forward given the ``labels`` attaches to the logits'
    backward."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, padded_vocab_size: int, moe: MoEConfig | None = None):
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        ops = fused_ops(cfg.compile)
        positions = SequencePositions()  # one module, read by the embedding and every attention
        self.embedding: Embedding | None = Embedding(cfg, padded_vocab_size, positions)
        sparse = (moe_layer_pattern(moe.moe_layer_freq, cfg.num_layers) if moe is not None and moe.num_experts
                  else [False] * cfg.num_layers)
        self.layers = nn.ModuleDict({str(i): TransformerLayer(cfg, ops, positions, moe if sparse[i] else None)
                                     for i in range(cfg.num_layers)})
        self.final_layernorm: nn.Module | None = norm(cfg)
        self.mtp: MultiTokenPrediction | None = None
        if cfg.mtp_num_layers:
            self.mtp = MultiTokenPrediction(cfg, [TransformerLayer(cfg, ops, positions, moe if sparse[-1] else None)
                                                  for _ in range(cfg.mtp_num_layers)])
        # Untied (Llama): its own [V, h] output weight, read by ``logits`` (never called as a module).
        self.lm_head: nn.Module | None = None if cfg.tied_embeddings else nn.Linear(cfg.hidden_size,
                                                                                  padded_vocab_size, bias=False)
        # Tied, with the embedding in another model chunk: a copy of it (``ptdp.parallel.pipeline.stage``).
        self.output_layer: nn.Module | None = None
        # Multi-token prediction's copy of the embedding, on a chunk without it (the same place).
        self.embedding_copy: Embedding | None = None
        self.logits = Logits(vocab_size)

    def sharding_rules(self) -> ShardingRules:
        """How the parallelisms may split this model (``ptdp.models.gpt_sharding``)."""
        return gpt_sharding_rules(self.cfg)

    def pipeline_parts(self) -> PipelineParts:
        """How the pipeline cuts this model into stages (``ptdp.models.parts``): what the pipeline split and
        vocabulary parallelism read instead of this class's attribute names."""
        return PIPELINE_PARTS

    def output_weight(self) -> torch.Tensor:
        """The ``[V, h]`` weight of the logits: the untied head's, else the input embedding's (or its copy)."""
        if self.lm_head is not None:
            return self.lm_head.weight
        if self.embedding is not None:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    def run_layers(self, x: torch.Tensor, documents: DocumentLayout | None = None) -> torch.Tensor:
        """The transformer layers in order (full recomputation overrides this: ``ptdp.parallel.recompute``)."""
        for layer in self.layers.values():
            x = layer(x, documents)
        return x

    def forward(self, x: torch.Tensor, documents: DocumentLayout | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (with an embedding) or hidden states in; logits (with a final norm) or hidden states out.
        ``documents``: the packed microbatch's document layout (positions and attention stop at each end of
        document; ``ptdp.models.documents``), or None: one causal window. ``labels`` (the next tokens,
        ``[b, s]``) feed the multi-token prediction loss, if the model has one."""
        if self.embedding is not None:
            x = self.embedding(x, documents)
        x = self.run_layers(x, documents)
        if self.final_layernorm is None:
            return x
        return self.head(x, labels)

    def head(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm and the logits; training with ``labels``, the multi-token prediction modules first
        (their loss attached to the backward of the hidden states the logits read)."""
        embedding = self.embedding if self.embedding is not None else self.embedding_copy
        shared = self.lm_head is None and embedding is not None  # the output weight also embeds here
        x = self.final_layernorm(x)
        if self.mtp is not None and labels is not None and self.training:
            x = self.mtp(x, labels, embedding, lambda h: self.logits(h, self.output_weight(), shared))
        return self.logits(x, self.output_weight(), shared)

    def program(self, inp: str, documents: DocumentLayout | None = None, labels: torch.Tensor | None = None
                ) -> tuple[list[Step], str]:
        """``forward`` as pieces (``ptdp.models.pieces``) from the value ``inp``, and the name of its output:
        the embedding, each layer's pieces (:meth:`layer_steps`), the head (with the multi-token prediction
        modules, given the ``labels``) -- those this chunk holds."""
        steps, name = [], inp
        if self.embedding is not None:
            steps.append(Compute(lambda ids: (self.embedding(ids, documents),), (name,), ("embedded",), "embedding"))
            name = "embedded"
        for key, layer in self.layers.items():
            steps += self.layer_steps(key, layer.steps(name, f"layer{key}", documents))
            name = f"layer{key}"
        if self.final_layernorm is not None:
            steps.append(Compute(lambda x: (self.head(x, labels),), (name,), ("logits",), "head"))
            name = "logits"
        return steps, name

    def layer_steps(self, key: str, steps: list[Step]) -> list[Step]:
        """Layer ``key``'s pieces as the program runs them (full recomputation overrides this, as
        :meth:`run_layers`: ``ptdp.parallel.recompute``)."""
        return steps
