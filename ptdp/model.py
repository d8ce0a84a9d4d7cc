"""The GPT model (Megatron's GPT = the GPT-2 architecture) built from tensor-parallel layers.

Read it top to bottom like nanoGPT: learned position embeddings, pre-LayerNorm blocks of causal
self-attention and a GeLU MLP of ``ffn_hidden_size`` (4h), a final LayerNorm and logits tied to the input
embedding. Tensor parallelism lives entirely inside the layers (``ptdp.tensor_parallel``); the model
knows nothing about pipelines. Under sequence parallelism the residual stream between layers is
``[b, s/t, h]``: LayerNorm and dropout each work on this rank's tokens only. Biases are returned by the
linears and fused into the next element-wise op (``ptdp.fused``). Under context parallelism (``cp_group``,
``ptdp.context_parallel``) every tensor holds this CP rank's s/c tokens, the two load-balanced chunks of
the sequence: positions (learned or rotary) are those tokens' real positions, and only the attention core
talks to the other CP ranks; every other op is per token. Activation recomputation
(``ptdp.recompute``) wraps either whole layers or only the attention core. A :class:`GPTModel` can be a *chunk* of the full model: the layers
``[first_layer, first_layer + num_layers)``, with the embedding if it is the first chunk and the output
layer if it is the last. Parameter names are the logical ones of the full model (``layers.7.mlp.fc1.weight``
is layer 7 on whichever rank holds it), so checkpoints and exports do not depend on the layout.

The Llama family is the same model with five options (Megatron's flags, ``ModelConfig``): rotary instead
of learned positions (``ptdp.rotary``, applied to each rank's own heads), RMSNorm instead of LayerNorm,
a SwiGLU MLP whose gate and up projections are one column-parallel weight ``[2, ffn, h]`` (so each rank
holds the same rows of both whatever t is), grouped-query attention (G key/value heads; the QKV weight is
``[(a + 2G)·d, h]`` in Megatron's order, per group its a/G query heads then its key and its value head, so
t splits it into whole groups), and no linear biases with an output layer ``lm_head`` untied from the
embedding.
"""

from __future__ import annotations

import contextlib
import functools
import math
import zlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .fused import FusedOps, fused_ops
from .norms import LayerNorm, RMSNorm
from .recompute import checkpoint, recompute_plan
from .rotary import RotaryEmbedding
from .tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    get_rng_tracker,
    scatter_to_sequence_parallel_region,
    vocab_parallel_cross_entropy,
)
from .tensor_parallel.cross_entropy import mask_padded_vocab_
from .tensor_parallel.mappings import group_rank, group_size
from .tensor_parallel.weight_grad import linear

TIED_EMBEDDING = "embedding.word_embeddings.weight"
HEAD_COPY = "output_layer.weight"  # the last stage's copy of the tied embedding when p > 1


def norm(cfg: ModelConfig) -> nn.Module:
    """``--normalization``: LayerNorm (GPT-2) or RMSNorm (Llama: no bias, no mean subtraction)."""
    if cfg.normalization == "RMSNorm":  # nn.RMSNorm / nn.LayerNorm with W-deferrable weight grads
        return RMSNorm(cfg.hidden_size, eps=cfg.norm_epsilon)
    return LayerNorm(cfg.hidden_size, eps=cfg.norm_epsilon)


class ParallelAttention(nn.Module):
    """Causal self-attention over this rank's a/t query heads (and G/t key/value groups with GQA), through
    SDPA (flash kernels on GPU); rotary positions, when on, rotate this rank's q and k heads."""

    def __init__(self, cfg: ModelConfig, tp_group, sequence_parallel: bool, fuse_bias: bool,
                 cp_group=None, cp_comm_type: str = "p2p"):
        super().__init__()
        h, a, t, d = cfg.hidden_size, cfg.num_attention_heads, group_size(tp_group), cfg.head_dim
        self.cp_group, self.cp_comm_type = cp_group, cp_comm_type
        self.cp_size, self.cp_rank = group_size(cp_group), group_rank(cp_group)
        self.local_heads, self.head_dim = a // t, d
        self.grouped = cfg.group_query_attention
        self.local_groups, self.heads_per_group = cfg.query_groups // t, a // cfg.query_groups
        self.dropout = cfg.attention_dropout
        self.recompute_core = cfg.recompute_granularity == "selective"
        self.rotary = (RotaryEmbedding(d, cfg.rotary_percent, cfg.rotary_base,
                                       cfg.rope_scaling_factor if cfg.use_rope_scaling else None)
                       if cfg.position_embedding_type == "rope" else None)
        bias = cfg.add_bias_linear
        if self.grouped:  # per group: its a/G query heads, its key head, its value head (Megatron's order)
            self.qkv = ColumnParallelLinear(h, (a + 2 * cfg.query_groups) * d, tp_group=tp_group, bias=bias,
                                            sequence_parallel=sequence_parallel)
        else:  # [3, a·d, h]: all q heads, all k heads, all v heads
            self.qkv = ColumnParallelLinear(h, a * d, tp_group=tp_group, fused=3, bias=bias,
                                            sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(a * d, h, tp_group=tp_group, bias=bias, sequence_parallel=sequence_parallel,
                                      skip_bias_add=fuse_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The output, or with ``fuse_bias`` the output before its bias and the bias (see TransformerLayer)."""
        qkv = self.qkv(x)  # [b, s, 3 * h/t]: this rank's heads of q, then of k, then of v
        # selective recomputation: the core holds the a·s² activations but costs few FLOPs to redo
        y = checkpoint(self.core, qkv) if self.recompute_core and torch.is_grad_enabled() else self.core(qkv)
        return self.proj(y)

    def core(self, qkv: torch.Tensor) -> torch.Tensor:
        """softmax(QK^T / sqrt(d)) with dropout, times V, for this rank's heads; [b, s, a·d/t] out."""
        b, s, _ = qkv.shape
        if self.grouped:
            groups = qkv.view(b, s, self.local_groups, self.heads_per_group + 2, self.head_dim)
            q = groups[:, :, :, :-2].reshape(b, s, self.local_heads, self.head_dim).transpose(1, 2)
            k, v = groups[:, :, :, -2].transpose(1, 2), groups[:, :, :, -1].transpose(1, 2)
        else:
            q, k, v = qkv.view(b, s, 3, self.local_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.rotary is not None:  # at the real positions of this CP rank's tokens
            q, k = self.rotary(q, self.cp_size, self.cp_rank), self.rotary(k, self.cp_size, self.cp_rank)
        if self.grouped and self.heads_per_group > 1:  # query head j attends with key/value group j // (a/G)
            k, v = k.repeat_interleave(self.heads_per_group, 1), v.repeat_interleave(self.heads_per_group, 1)
        dropout = self.dropout if self.training else 0.0
        # Heads are split across TP ranks: masks must differ per rank. Without dropout no stream is
        # needed, and swapping generator states would split a compiled layer into pieces (graph breaks).
        with get_rng_tracker().fork() if dropout > 0.0 else contextlib.nullcontext():
            if self.cp_size > 1:  # causal over the real positions of the load-balanced chunks
                from .context_parallel import context_parallel_attention

                y = context_parallel_attention(q, k, v, cp_group=self.cp_group, comm_type=self.cp_comm_type,
                                               dropout_p=dropout)
            else:
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)


class ParallelMLP(nn.Module):
    """GeLU MLP fc2(gelu(fc1(x))), or with ``--swiglu`` fc2(silu(gate(x)) * up(x)) where fc1 = [gate; up]."""

    def __init__(self, cfg: ModelConfig, tp_group, sequence_parallel: bool, ops: FusedOps):
        super().__init__()
        self.swiglu = cfg.swiglu
        fuse = ops.compiled and not cfg.swiglu and cfg.add_bias_linear
        # Eagerly, the bias is cheapest inside the GEMM (addmm); compiled, it fuses with the GeLU.
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_size, tp_group=tp_group, fused=2 if cfg.swiglu else 1,
                                        bias=cfg.add_bias_linear, sequence_parallel=sequence_parallel,
                                        skip_bias_add=fuse)
        self.fc2 = RowParallelLinear(cfg.ffn_size, cfg.hidden_size, tp_group=tp_group, bias=cfg.add_bias_linear,
                                     sequence_parallel=sequence_parallel, skip_bias_add=ops.compiled)
        self.ops, self.fuse = ops, fuse

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The output, or (compiled ops) the output before its bias and the bias."""
        if self.swiglu:  # this rank's gate rows, then its up rows (fc1's weight is [2, ffn/t, h] here)
            gate, up = self.fc1(x).chunk(2, dim=-1)
            return self.fc2(F.silu(gate) * up)
        h = self.ops.bias_gelu(*self.fc1(x)) if self.fuse else F.gelu(self.fc1(x), approximate="tanh")
        return self.fc2(h)


class TransformerLayer(nn.Module):
    """Pre-LayerNorm block: x + drop(attn(ln(x)) + bias), then x + drop(mlp(ln(x)) + bias).

    Under ``--compile`` the output biases of attention and MLP arrive separately and are added inside
    ``bias_dropout_add``, one fused kernel (``ptdp.fused``); eagerly they are already inside the GEMM.
    """

    def __init__(self, cfg: ModelConfig, tp_group, sequence_parallel: bool, ops: FusedOps, cp_group=None,
                 cp_comm_type: str = "p2p"):
        super().__init__()
        self.input_layernorm = norm(cfg)
        self.attention = ParallelAttention(cfg, tp_group, sequence_parallel, fuse_bias=ops.compiled,
                                           cp_group=cp_group, cp_comm_type=cp_comm_type)
        self.post_attention_layernorm = norm(cfg)
        self.mlp = ParallelMLP(cfg, tp_group, sequence_parallel, ops)
        self.hidden_dropout = cfg.hidden_dropout
        self.sequence_parallel = sequence_parallel
        self.ops = ops

    def _bias_dropout_add(self, out, residual: torch.Tensor) -> torch.Tensor:
        y, bias = out if isinstance(out, tuple) else (out, None)
        training = self.training and self.hidden_dropout > 0.0
        if training and self.sequence_parallel:  # each rank holds different tokens: independent masks
            with get_rng_tracker().fork():
                return self.ops.bias_dropout_add(y, bias, residual, self.hidden_dropout, training)
        return self.ops.bias_dropout_add(y, bias, residual, self.hidden_dropout, training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._bias_dropout_add(self.attention(self.input_layernorm(x)), x)
        return self._bias_dropout_add(self.mlp(self.post_attention_layernorm(x)), x)


class GPTEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, padded_vocab_size: int, tp_group, cp_group=None):
        super().__init__()
        self.cp_size, self.cp_rank = group_size(cp_group), group_rank(cp_group)
        self.word_embeddings = VocabParallelEmbedding(padded_vocab_size, cfg.hidden_size, tp_group=tp_group)
        self.position_embeddings = (nn.Embedding(cfg.seq_length, cfg.hidden_size)
                                    if cfg.position_embedding_type == "learned_absolute" else None)  # else RoPE
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            if self.cp_size > 1:  # this CP rank's tokens are chunks i and 2c-1-i of the sequence
                from .context_parallel import load_balanced_positions

                positions = load_balanced_positions(tokens.shape[1] * self.cp_size, self.cp_size, self.cp_rank,
                                                    device=tokens.device)
            else:
                positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = x + self.position_embeddings(positions)
        return self.dropout(x)


class GPTModel(nn.Module):
    """The full GPT, or one pipeline chunk of it (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, padded_vocab_size: int, *, tp_group=None,
                 first_layer: int = 0, num_layers: int | None = None, pre_process: bool = True,
                 post_process: bool = True, sequence_parallel: bool = False, cp_group=None,
                 cp_comm_type: str = "p2p"):
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.tp_group = tp_group
        self.pre_process, self.post_process = pre_process, post_process
        self.sequence_parallel = sequence_parallel and group_size(tp_group) > 1
        num_layers = cfg.num_layers if num_layers is None else num_layers
        ops = fused_ops(cfg.compile)
        self.embedding = GPTEmbedding(cfg, padded_vocab_size, tp_group, cp_group) if pre_process else None
        self.layers = nn.ModuleDict({
            str(i): TransformerLayer(cfg, tp_group, self.sequence_parallel, ops, cp_group, cp_comm_type)
            for i in range(first_layer, first_layer + num_layers)
        })
        self.recompute_plan = recompute_plan(num_layers, cfg.recompute_granularity, cfg.recompute_method,
                                             cfg.recompute_num_layers)
        if post_process:
            self.final_layernorm = norm(cfg)
            if not cfg.tied_embeddings:  # its own [V, h] weight, split by vocabulary rows like the embedding
                self.lm_head = VocabParallelEmbedding(padded_vocab_size, cfg.hidden_size, tp_group=tp_group)
            elif not pre_process:  # a separate stage: keep a copy of the tied embedding, synced by grads
                self.output_layer = VocabParallelEmbedding(padded_vocab_size, cfg.hidden_size, tp_group=tp_group)
        for name, param in self.named_parameters():
            param.no_weight_decay = name.endswith("bias") or "layernorm" in name  # Megatron's rule
            if self.sequence_parallel and "layernorm" in name:
                param.sequence_parallel = True  # its grads are partial sums over this rank's tokens

    @property
    def output_weight(self) -> torch.Tensor:
        if not self.cfg.tied_embeddings:
            return self.lm_head.weight
        return self.embedding.word_embeddings.weight if self.pre_process else self.output_layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids ``[b, s]`` (first chunk) or hidden states in; hidden states or this rank's logits out."""
        if self.pre_process:
            x = self.embedding(x)
            if self.sequence_parallel:
                x = scatter_to_sequence_parallel_region(x, self.tp_group)
        layers = list(self.layers.values())
        for span, recompute in self.recompute_plan:  # full recomputation: a unit keeps only its input
            unit = functools.partial(run_layers, [layers[i] for i in span])
            x = checkpoint(unit, x) if recompute and torch.is_grad_enabled() else unit(x)
        if not self.post_process:
            return x
        x = self.final_layernorm(x)
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group)
        else:
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)
        # The padded vocabulary even at t=1: an aligned GEMM (N = 50304, not 50257), padding masked in place.
        # Its wgrad is deferrable to W, unless the weight is also this chunk's input embedding (tied): a
        # deferred half would fire its grad hooks twice per microbatch (``weight_grad``).
        gemm = F.linear if self.pre_process and self.cfg.tied_embeddings else linear
        return mask_padded_vocab_(gemm(x, self.output_weight), self.vocab_size, self.tp_group)


def run_layers(layers: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def language_model_loss(logits: torch.Tensor, labels: torch.Tensor, tp_group=None,
                        inplace_backward: bool = True) -> torch.Tensor:
    """Mean next-token cross-entropy of vocabulary-parallel logits (overwrites fp32 ``logits``: see
    ``vocab_parallel_cross_entropy``, also for ``inplace_backward``)."""
    return vocab_parallel_cross_entropy(logits, labels, tp_group, inplace_backward).mean()


def logical_name(name: str) -> str:
    """The full-model name of a parameter (the last stage's tied copy is the input embedding)."""
    return TIED_EMBEDDING if name == HEAD_COPY else name


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, tp_rank: int, tp_size: int, std: float, num_layers: int) -> None:
    """Initialise every parameter as the full model would be, then keep this rank's piece.

    Each full parameter is drawn from its own generator, seeded by (seed, logical name), so the full
    model is the same whatever t, p and d are, and the two copies of the tied embedding start equal.
    Only one full parameter exists at a time, so even a trillion-parameter model can start. Residual
    output projections are scaled by 1/sqrt(2 * num_layers) as in GPT-2 and Megatron.
    """
    for name, param in model.named_parameters():
        name = logical_name(name)
        if "layernorm" in name:
            param.fill_(1.0 if name.endswith("weight") else 0.0)
            continue
        if name.endswith("bias"):
            param.zero_()
            continue
        scaled = name.endswith(("attention.proj.weight", "mlp.fc2.weight"))
        full_shape = list(param.shape)
        parallel = getattr(param, "tensor_model_parallel", False)
        if parallel:
            full_shape[param.partition_dim] *= tp_size
        # Drawn on the CPU whatever the device: CPU and CUDA generators give different numbers, and the
        # model must be the same on every device (a CUDA run reproduces a CPU run; checkpoints move).
        generator = torch.Generator()
        generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
        full = torch.empty(full_shape, device="cpu")
        full.normal_(0.0, std / math.sqrt(2.0 * num_layers) if scaled else std, generator=generator)
        param.copy_(full.chunk(tp_size, param.partition_dim)[tp_rank] if parallel else full)
        del full
