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

Gemma 3 adds, by flags: sliding-window attention per layer (``attention.py``), sandwich norms, zero-centred
(1 + w) RMSNorms, a GeGLU MLP and embeddings scaled by √h.

Where a layer may be cut into pieces (what DualPipe's overlapped forward-and-backward interleaves with
another microbatch's backward) is declared with the pipeline parts (``PIPELINE_PARTS.cuts``,
``ptdp.models.parts.LayerCuts``); the pipeline does the cutting (``ptdp.parallel.pipeline.program``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ptdp.config.validate_linear import linear_attention_layers
from ptdp.config.validate_window import window_layers
from ptdp.models.attention import Attention
from ptdp.models.documents import DocumentLayout, position_ids
from ptdp.models.gated_deltanet import GatedDeltaNet
from ptdp.models.glu import gated_activation
from ptdp.models.gpt_sharding import gpt_sharding_rules
from ptdp.models.layers import (
    DropoutAdd,
    Linear,
    Logits,
    SequencePositions,
    norm,
)
from ptdp.models.mla import MultiLatentAttention
from ptdp.models.moe import MoELayer, moe_layer_pattern
from ptdp.models.mtp import MultiTokenPrediction
from ptdp.models.parts import Cut, Half, LayerCuts, PipelineParts
from ptdp.models.sharding import ShardingRules
from ptdp.ops.fused import EAGER, FusedOps, fused_ops

if TYPE_CHECKING:
    from ptdp.config import ModelConfig, MoEConfig

# Where a TransformerLayer may be cut (``ptdp.models.parts.LayerCuts``): its attention half, cut at the QKV
# projection's input (and the output gate's: it reads the same normed input) and the output projection's
# output -- a Gated DeltaNet's at its two input projections' input and out_proj's output -- then its MLP
# half, cut at fc1's input and fc2's output; a MoE layer's MLP is a program of pieces itself (``MoELayer.steps``).
LAYER_CUTS = LayerCuts(
    halves=(Half("attention", norm="input_layernorm", block="attention", residual="attention_residual",
                 cuts=(Cut(first=("qkv", "gate"), last="proj"),
                       Cut(first=("in_proj_qkvz", "in_proj_ba"), last="out_proj")), documents=True),
            Half("mlp", norm="post_attention_layernorm", block="mlp", residual="mlp_residual",
                 cuts=(Cut(first=("fc1",), last="fc2"),))),
    pieces="steps", selective="attention.core")
# How the pipeline cuts a GPTModel (``ptdp.models.parts``): the attribute names of ``GPTModel.__init__``.
PIPELINE_PARTS = PipelineParts(
    layers="layers", first=("embedding",), last=("final_layernorm", "lm_head", "mtp"), input_embedding="embedding",
    table="word_embeddings", final_norm="final_layernorm", untied_output="lm_head", to_logits="logits",
    multi_token_prediction="mtp", head_copy="output_layer", mtp_copy="embedding_copy", mtp_modules="layers",
    mtp_layer="transformer_layer", run_layers="run_layers", head="head", cuts=LAYER_CUTS)
TIED_EMBEDDING = PIPELINE_PARTS.table_weight  # the input embedding, also the output weight when tied


class _SkipMetaInit(TorchFunctionMode):
    """``torch.nn.init`` on a meta tensor does nothing but cost: its ``normal_`` is a Python decomposition
    whose first call imports ``torch._dynamo`` (about 1.2 s of CPU in every process that builds a model)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = args[0] if args else kwargs.get("tensor")
        if getattr(func, "__module__", None) == "torch.nn.init" and isinstance(tensor, torch.Tensor) and tensor.is_meta:
            return tensor
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Build modules on the meta device: their shapes, no memory and no initial values (ptdp draws every
    parameter itself, from the seed and its logical name: ``ptdp.parallel.init``)."""
    with torch.device("meta"), _SkipMetaInit():
        yield

class MLP(nn.Module):
    """GeLU MLP fc2(gelu(fc1(x))) (tanh or exact: ``ModelConfig.gelu_approximate``), or with ``--swiglu`` fc2(silu(gate(x)) * up(x)) where fc1 = [gate; up]
    (``--geglu``: the tanh GeLU for the SiLU; ``--quick-geglu``: GPT-OSS's; ``ptdp.models.glu``)."""

    def __init__(self, cfg: ModelConfig, ops: FusedOps):
        super().__init__()
        self.glu = gated_activation(cfg)  # SwiGLU, GeGLU or quick-GeGLU (ptdp.models.glu), None: GeLU
        # Eagerly, the bias is cheapest inside the GEMM (addmm); compiled, it fuses with the GeLU.
        self.fuse = ops.compiled and not cfg.gated_mlp and cfg.add_bias_linear
        self.fc1 = Linear(cfg.hidden_size, cfg.ffn_size, fused=2 if cfg.gated_mlp else 1, bias=cfg.add_bias_linear,
                          skip_bias_add=self.fuse)
        self.fc2 = Linear(cfg.ffn_size, cfg.hidden_size, bias=cfg.add_bias_linear, skip_bias_add=ops.compiled)
        self.ops = ops
        self.approximate = cfg.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """The output, or (compiled ops) the output before its bias and the bias."""
        fc1, fc2 = self.fc1, self.fc2
        if self.glu is not None:  # the gate rows, then the up rows (fc1's weight is [2, ffn, h])
            return fc2(self.glu(fc1(x)))
        if self.fuse:
            return fc2(self.ops.bias_gelu(*fc1(x), self.approximate))
        h = F.gelu(fc1(x), approximate=self.approximate)
        return fc2(h)


def moe_mlp(cfg: ModelConfig, moe: MoEConfig) -> MoELayer:
    """The MoE layer that replaces the MLP (``ptdp.models.moe``), with its shared expert if any."""
    shared = None
    if moe.moe_shared_expert_intermediate_size:
        shared = MLP(dataclasses.replace(cfg, ffn_hidden_size=moe.moe_shared_expert_intermediate_size), EAGER)
    return MoELayer(cfg, moe, shared)


class TransformerLayer(nn.Module):
    """Pre-LayerNorm block: x + drop(attn(ln(x)) + bias), then x + drop(mlp(ln(x)) + bias); with ``moe``
    the MLP is a mixture of experts, with ``--multi-latent-attention`` the attention is MLA (``mla.py``).
    ``--sandwich-norm`` (Gemma) also normalises each half's output before its residual add
    (``post_self_attn_layernorm``, ``post_mlp_layernorm``); ``window``: the attention's sliding window;
    ``linear``: a Gated DeltaNet (``gated_deltanet.py``) in place of the attention."""

    def __init__(self, cfg: ModelConfig, ops: FusedOps, positions: SequencePositions, moe: MoEConfig | None = None,
                 window: int | None = None, linear: bool = False):
        super().__init__()
        self.input_layernorm = norm(cfg)
        if linear:
            self.attention = GatedDeltaNet(cfg, fuse_bias=ops.compiled)
        elif cfg.multi_latent_attention:
            self.attention = MultiLatentAttention(cfg, positions, fuse_bias=ops.compiled)
        else:
            self.attention = Attention(cfg, positions, fuse_bias=ops.compiled, window=window)
        self.post_self_attn_layernorm = norm(cfg) if cfg.sandwich_norm else None
        self.post_attention_layernorm = norm(cfg)
        self.mlp = moe_mlp(cfg, moe) if moe is not None else MLP(cfg, ops)
        self.post_mlp_layernorm = norm(cfg) if cfg.sandwich_norm else None
        self.dropout_add = DropoutAdd(cfg.hidden_dropout, ops)

    def forward(self, x: torch.Tensor, documents: DocumentLayout | None = None) -> torch.Tensor:
        return self.mlp_half(self.attention_half(x, documents))

    def attention_half(self, x: torch.Tensor, documents: DocumentLayout | None = None) -> torch.Tensor:
        return self.attention_residual(self.attention(self.input_layernorm(x), documents), x)

    def mlp_half(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp_residual(self.mlp(self.post_attention_layernorm(x)), x)

    def attention_residual(self, out: torch.Tensor | tuple, x: torch.Tensor) -> torch.Tensor:
        """``x`` + the attention's output (and bias), through ``post_self_attn_layernorm`` if any."""
        return self.dropout_add(_post_norm(self.post_self_attn_layernorm, out), x)

    def mlp_residual(self, out: torch.Tensor | tuple, x: torch.Tensor) -> torch.Tensor:
        """``x`` + the MLP's output (and bias), through ``post_mlp_layernorm`` if any."""
        return self.dropout_add(_post_norm(self.post_mlp_layernorm, out), x)


def _post_norm(norm: nn.Module | None, out: torch.Tensor | tuple) -> torch.Tensor | tuple:
    """``norm`` of a half's output, its bias added first (a sandwich norm); the output as is without one."""
    if norm is None:
        return out
    y, bias = out if isinstance(out, tuple) else (out, None)
    return norm(y if bias is None else y + bias)


class Embedding(nn.Module):
    """Token embeddings plus (GPT-2) learned position embeddings (``--scale-embedding``: times √h, rounded
    to the table's dtype first, as Gemma), then dropout."""

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int, positions: SequencePositions):
        super().__init__()
        self.word_embeddings = nn.Embedding(padded_vocab_size, cfg.hidden_size)
        self.position_embeddings = (nn.Embedding(cfg.max_position_embeddings or cfg.seq_length, cfg.hidden_size)
                                    if cfg.position_embedding_type == "learned_absolute" else None)  # else RoPE
        self.positions = positions
        self.scale = cfg.hidden_size ** 0.5 if cfg.scale_embedding else None
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, tokens: torch.Tensor, documents: DocumentLayout | None = None) -> torch.Tensor:
        x = self.word_embeddings(tokens)
        if self.scale is not None:
            x = x * torch.tensor(self.scale, dtype=torch.float32).to(x.dtype)
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
        windows = window_layers(cfg)  # --window-size: per layer its sliding window or None
        linear = linear_attention_layers(cfg)  # --linear-attention-freq: the Gated DeltaNet layers
        self.layers = nn.ModuleDict({str(i): TransformerLayer(cfg, ops, positions, moe if sparse[i] else None,
                                                              windows[i], linear[i]) for i in range(cfg.num_layers)})
        self.final_layernorm: nn.Module | None = norm(cfg)
        self.mtp: MultiTokenPrediction | None = None
        if cfg.mtp_num_layers:
            self.mtp = MultiTokenPrediction(cfg, [TransformerLayer(cfg, ops, positions, moe if sparse[-1] else None,
                                                                   windows[-1], linear[-1])
                                                  for _ in range(cfg.mtp_num_layers)])
        # Untied (Llama): its own [V, h] output weight, read by ``logits`` (never called as a module).
        self.lm_head: nn.Module | None = None if cfg.tied_embeddings else nn.Linear(cfg.hidden_size,
                                                                                  padded_vocab_size, bias=False)
        # Tied, with the embedding in another model chunk: a copy of it (``ptdp.parallel.pipeline.stage``).
        self.output_layer: nn.Module | None = None
        # Multi-token prediction's copy of the embedding, on a chunk without it (the same place).
        self.embedding_copy: Embedding | None = None
        self.logits = Logits(vocab_size, cfg.final_logit_softcapping)

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
        """The transformer layers in order (full recomputation replaces this, ``PipelineParts.run_layers``:
        ``ptdp.parallel.recompute``)."""
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
