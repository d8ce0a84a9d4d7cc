"""The building blocks of the plain models: one process, plain torch, no parallelism.

Each block is the single-process version of something a parallelism may replace from outside
(``ptdp.parallel``): ``Linear`` becomes a column- or row-parallel linear, ``nn.Embedding`` a vocabulary-
parallel one, ``Logits`` the vocabulary-parallel logits, ``SequencePositions`` the load-balanced positions of
context parallelism and ``CausalAttention`` a context-parallel attention core. Swapping a block keeps the
parameter names, so checkpoints do not depend on the layout.

The weight-bearing ops are ``ptdp.ops``' deferrable ones: numerically the plain ops, but a zero-bubble
schedule can defer their weight gradients to a W pass (``ptdp.ops.weight_grad``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ptdp.models.documents import DocumentLayout, masks_attention
from ptdp.models.sinks import sink_attention
from ptdp.models.window import document_window_attention, local_window_attention
from ptdp.ops.fused import FusedOps
from ptdp.ops.norms import LayerNorm, RMSNorm
from ptdp.ops.weight_grad import linear

if TYPE_CHECKING:
    from ptdp.config import ModelConfig
    from ptdp.ops.flex_window import FlexWindow

RngContext = Callable[[], contextlib.AbstractContextManager]  # e.g. the tensor-parallel RNG tracker's fork


def norm(cfg: ModelConfig, size: int | None = None) -> nn.Module:
    """``--normalization`` over ``size`` features (default the hidden size): LayerNorm (GPT-2; without its bias
    under ``--disable-bias-norm``) or RMSNorm (Llama: no bias, no mean subtraction); with
    ``--apply-layernorm-1p`` the zero-centred RMSNorm (Gemma)."""
    if cfg.apply_layernorm_1p:
        return ZeroCenteredRMSNorm(size or cfg.hidden_size, eps=cfg.norm_epsilon)
    if cfg.normalization == "RMSNorm":
        return RMSNorm(size or cfg.hidden_size, eps=cfg.norm_epsilon)
    return LayerNorm(size or cfg.hidden_size, eps=cfg.norm_epsilon, bias=not cfg.disable_bias_norm)


class ZeroCenteredRMSNorm(nn.Module):
    """``x / rms(x) · (1 + w)`` over the last dimension, all in fp32 and rounded to x's dtype once at the end
    (Gemma's RMSNorm: ``w`` starts at 0; a bf16 model multiplies by 1 + w before rounding, not after)."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class Linear(nn.Module):
    """``y = x Wᵀ + b``. ``fused`` = k > 1 packs k independent projections (q, k and v; gate and up) into
    one weight ``[k, out, in]`` (bias ``[k, out]``), the layout checkpoints use: a tensor-parallel split of
    dim 1 then gives each rank the same rows of all k. ``skip_bias_add`` returns ``(x Wᵀ, b)`` so the
    caller can fuse the bias into the element-wise op that follows (``ptdp.ops.fused``)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, fused: int = 1,
                 skip_bias_add: bool = False):
        super().__init__()
        shape = (out_features, in_features) if fused == 1 else (fused, out_features, in_features)
        self.weight = nn.Parameter(torch.empty(shape))
        self.bias = nn.Parameter(torch.zeros(shape[:-1])) if bias else None
        self.skip_bias_add = skip_bias_add
        self.adapter: nn.Module | None = None  # a LoRA adapter (``ptdp.parallel.lora``): adapted(self, x, y)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        if self.skip_bias_add:
            return adapted(self, x, linear(x, self.weight)), None if self.bias is None else self.bias.flatten()
        return adapted(self, x, linear(x, self.weight, self.bias))


def adapted(linear_module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y`` (the linear's GEMM of ``x``, before any reduction a parallelism adds) plus its adapter's output on
    the same input, when one is attached (LoRA: ``ptdp.parallel.lora``); ``y`` itself otherwise. The seam
    every linear block calls, the split ones too, so that an adapter sees the input its linear sees."""
    adapter = linear_module.adapter
    return y if adapter is None else y + adapter(x)


class _MaskPadding(torch.autograd.Function):
    """In place: logits columns from ``first_padding`` on := -inf, no copy forward or backward. The
    gradient passes unchanged: for a softmax loss the gradient at a -inf logit is exactly 0 already."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, first_padding: int):
        ctx.mark_dirty(logits)
        logits[..., first_padding:].fill_(float("-inf"))
        return logits

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def mask_padding_(logits: torch.Tensor, vocab_size: int, first_id: int = 0) -> torch.Tensor:
    """Set, in place, the logits of padding ids (>= ``vocab_size``) to -inf; the columns of ``logits``
    are the ids ``first_id, first_id + 1, ...`` (a vocabulary-parallel rank's slice starts later)."""
    local = logits.shape[-1]
    if first_id + local <= vocab_size:
        return logits
    return _MaskPadding.apply(logits, max(vocab_size - first_id, 0))


def softcap_logits(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """``--final-logit-softcapping``: cap·tanh(logit/cap), elementwise (so a vocabulary shard caps its own
    columns before the vocabulary-parallel softmax); the -inf of the padding columns stays -inf."""
    return torch.where(torch.isinf(logits), logits, cap * torch.tanh(logits / cap))


class Logits(nn.Module):
    """Logits over the padded vocabulary (an aligned GEMM: N = 50304, not 50257), padding masked in place.

    The weight is the model's output weight (``GPTModel.output_weight``). Its gradient is deferrable to a
    zero-bubble W pass unless ``shared``: the weight is also this model's input embedding (tied), whose
    grad hooks a deferred half would fire twice per microbatch (``ptdp.ops.weight_grad``). ``softcap``
    (``--final-logit-softcapping``) caps them: part of this module, so that whoever replaces it (tensor or
    vocabulary parallelism) carries the cap with the GEMM.
    """

    def __init__(self, vocab_size: int, softcap: float | None = None):
        super().__init__()
        self.vocab_size, self.softcap = vocab_size, softcap

    def forward(self, x: torch.Tensor, weight: torch.Tensor, shared: bool) -> torch.Tensor:
        gemm = F.linear if shared else linear
        logits = mask_padding_(gemm(x, weight), self.vocab_size)
        return logits if self.softcap is None else softcap_logits(logits, self.softcap)


class SequencePositions(nn.Module):
    """The positions of the ``seq_len`` tokens this process holds: ``0 .. seq_len-1``. Learned position
    embeddings and rotary tables read them; context parallelism swaps in its load-balanced positions."""

    def forward(self, seq_len: int, device: torch.device) -> torch.Tensor:
        return torch.arange(seq_len, device=device)


def window_mask(s: int, window: int, device: torch.device) -> torch.Tensor:
    """``[s, s]`` booleans: query i attends to key j iff i - window < j <= i (the window counts the token
    itself, as HF's ``sliding_window`` does)."""
    i = torch.arange(s, device=device)[:, None]
    j = torch.arange(s, device=device)[None, :]
    return (j <= i) & (j > i - window)


class CausalAttention(nn.Module):
    """softmax(QKᵀ/√d) V under a causal mask, through SDPA (flash kernels on GPU). q, k, v: ``[b, heads,
    s, d]`` (k and v already repeated to the query heads). With a ``documents`` layout that masks attention
    (``--reset-attention-mask``) each token attends only inside its document, through the kernel chosen at
    start-up (``ptdp.ops.document_attention``). Context parallelism swaps in its ring/all-to-all/all-gather
    version of the same function. ``window`` (``--window-size``): a sliding window, computed in tiles of the
    keys each query can see (``ptdp.models.window``: O(s·w), the keys :func:`window_mask` allows); with
    document masks the window (or the sinks) runs inside each document
    (``ptdp.models.window.document_window_attention``)."""

    def __init__(self, window: int | None = None, softcap: float | None = None):
        super().__init__()
        self.window = window
        self.softcap = softcap  # --attn-logit-softcapping: explicit scores (the tiles), never SDPA
        # the kernel of windowed / sink / capped attention chosen at start-up (ptdp.ops.flex_window); None: the
        # exact tiles below, the CPU's path and the reference
        self.kernel: FlexWindow | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                documents: DocumentLayout | None = None, scale: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``scale``: the softmax scale when it is not 1/√d (multi-latent attention's YaRN temperature,
        ``--softmax-scale``); ``sinks [heads]``: one more logit per head in the softmax (``--softmax-type``,
        ``ptdp.models.sinks``)."""
        capped = self.softcap is not None
        if (self.kernel is not None and (self.window is not None or sinks is not None or capped)
                and self.kernel.applies(q, k, v, dropout_p)):
            inside = masks_attention(documents)
            return self.kernel(q, k, v, self.window, documents.bounds if inside else None,
                               documents.cache if inside else None, scale=scale, sinks=sinks, softcap=self.softcap)
        if masks_attention(documents):
            if self.window is not None or sinks is not None or capped:  # the windows (sinks) inside each document
                return document_window_attention(q, k, v, self.window, documents.bounds, scale=scale, sinks=sinks,
                                                 dropout_p=dropout_p, softcap=self.softcap)
            return documents.attend(q, k, v, dropout_p, scale)
        if (self.window is not None and self.window < q.shape[-2]) or capped:  # O(s·w) tiles, not an s x s mask
            return local_window_attention(q, k, v, min(self.window or q.shape[-2], q.shape[-2]), scale=scale,
                                          sinks=sinks, dropout_p=dropout_p, softcap=self.softcap)
        if sinks is not None:
            return sink_attention(q, k, v, sinks, None, dropout_p, scale)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale)


def use_window_kernel(modules: list[nn.Module], kernel: FlexWindow | None) -> None:
    """Every one-process attention core of ``modules`` (model chunks) runs its windowed / sink / capped
    attention through ``kernel`` (None: the exact tiles). Context parallelism's cores keep their own paths."""
    for chunk in modules:
        for module in chunk.modules():
            if type(module) is CausalAttention:
                module.kernel = kernel


class CrossEntropy(nn.Module):
    """Per-token cross-entropy of logits ``[..., V]`` (fp32) against labels ``[...]``: the loss of the heads
    a model computes itself (multi-token prediction). Tensor parallelism swaps in the vocabulary-parallel
    one, as it does for the logits."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="none").view_as(labels)


class AuxiliaryLoss(nn.Module):
    """A module whose forward adds a term to the training objective through the backward only
    (:func:`attach_aux_loss`): the MoE load-balancing and z-losses, the multi-token prediction loss. The
    trainer sets ``aux_loss_scale`` to the LM loss's weight (1/m · the fp16 loss scale,
    :func:`set_aux_loss_scale`); ``stats`` holds what the module measured since the trainer last read it."""

    def __init__(self) -> None:
        super().__init__()
        self.aux_loss_scale = 1.0
        self.stats: dict[str, torch.Tensor] = {}


class _AttachLoss(torch.autograd.Function):
    """Identity on ``output``; in the backward, ``loss`` gets the gradient ``scale`` (its weight in the
    objective), so the parameters learn from it without it being added to the reported LM loss."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(loss)
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


def attach_aux_loss(output: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
    """``output``, through which the backward also differentiates ``scale · loss`` (Megatron's
    ``MoEAuxLossAutoScaler`` / ``MTPLossAutoScaler``)."""
    return _AttachLoss.apply(output, loss, scale)


def set_aux_loss_scale(modules: list[nn.Module], scale: float) -> None:
    """The gradient every auxiliary loss of ``modules`` (model chunks) gets in the backward."""
    for chunk in modules:
        for module in chunk.modules():
            if isinstance(module, AuxiliaryLoss):
                module.aux_loss_scale = scale


def in_backward() -> bool:
    """Whether autograd is running a backward (a recomputed forward must not count its statistics twice)."""
    return torch._C._current_graph_task_id() != -1


class DropoutAdd(nn.Module):
    """``residual + dropout(y + bias)``, the end of each half of a transformer layer, as one fused op.

    ``rng``, when set, is a context that switches the random stream for the mask: sequence parallelism
    sets it so that ranks holding different tokens draw different masks.
    """

    def __init__(self, p: float, ops: FusedOps):
        super().__init__()
        self.p, self.ops = p, ops
        self.rng: RngContext | None = None

    def forward(self, out: torch.Tensor | tuple[torch.Tensor, torch.Tensor | None],
                residual: torch.Tensor) -> torch.Tensor:
        y, bias = out if isinstance(out, tuple) else (out, None)
        training = self.training and self.p > 0.0
        with self.rng() if training and self.rng is not None else contextlib.nullcontext():
            return self.ops.bias_dropout_add(y, bias, residual, self.p, training)
