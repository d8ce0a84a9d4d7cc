"""Tensor-parallel layers (Megatron-Core names): column-/row-parallel linears and a vocab-parallel embedding.

Each layer *declares* how its parameters are split across the TP group: ``PARTITION_DIMS`` maps a
parameter to the dimension of the *full* parameter that is cut into t contiguous equal pieces (counted
from the end, so a fused ``[3, out, in]`` weight and a plain ``[out, in]`` one say the same), this rank
holding piece ``tp_rank``; ``SEQUENCE_PARALLEL`` names the replicated parameters whose gradients are
partial under sequence parallelism. ``apply_tensor_parallel`` records both in the rank's placement
registry (``ptdp.parallel.placement``), which initialisation, checkpoints, clipping and the gradient
buffers read; nothing is set on the parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ptdp.models.layers import adapted, mask_padding_, softcap_logits
from ptdp.models.pieces import Transfer
from ptdp.ops.weight_grad import add_bias, linear
from ptdp.parallel.collectives import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    group_rank,
    group_size,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from ptdp.parallel.sequence.linear import sequence_parallel_linear
from ptdp.parallel.tensor.transfers import (
    CopyToRegion,
    GatherSequence,
    ReduceFromRegion,
    ReduceScatterSequence,
)


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator


class ColumnParallelLinear(nn.Module):
    """Y = X A with A split by columns: each rank computes its slice of the output features.

    ``fused`` > 1 packs that many independent column blocks (e.g. Q, K and V) into one weight of full
    shape ``[fused, output_size, input_size]`` split along dim 1, so each rank gets its own heads of all
    three and the split stays contiguous (a plain ``[3h, h]`` weight would need a strided split).
    With ``sequence_parallel`` the input arrives split along the sequence and is all-gathered here; only
    the split input is kept for the backward, which gathers it again (``sequence_linear``).
    ``skip_bias_add`` returns ``(output, bias)`` so the caller can fuse the bias into what follows.
    """

    fp8_linear = None  # the GEMM in FP8 when ``ptdp.parallel.fp8.enable_fp8`` set one
    PARTITION_DIMS = {"weight": -2, "bias": -1}  # the output features (of each fused block)
    SEQUENCE_PARALLEL: tuple[str, ...] = ()

    def __init__(self, input_size: int, output_size: int, *, tp_group=None, bias: bool = True,
                 gather_output: bool = False, fused: int = 1, sequence_parallel: bool = False,
                 skip_bias_add: bool = False):
        super().__init__()
        self.tp_group = tp_group
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel
        local_out = _divide(output_size, group_size(tp_group), "output size")
        shape = (local_out, input_size) if fused == 1 else (fused, local_out, input_size)
        self.weight = nn.Parameter(torch.empty(shape))
        self.bias = nn.Parameter(torch.zeros(shape[:-1])) if bias else None
        self.adapter: nn.Module | None = None  # LoRA (``ptdp.parallel.lora``): it enters the region itself

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # weight.flatten(0, -2) x + bias, with wgrad and bias grad deferrable to W (``weight_grad``)
        bias, x_in = None if self.skip_bias_add else self.bias, x
        if self.fp8_linear is not None:  # torchao's FP8 GEMM takes the whole (gathered) input
            if self.sequence_parallel:
                x = gather_from_sequence_parallel_region(x, self.tp_group)
            else:
                x = copy_to_tensor_model_parallel_region(x, self.tp_group)
            y = self.fp8_linear(x, self.weight, bias)
        elif self.sequence_parallel:  # all-gathers the sequence, but keeps only this rank's s/t for backward
            y = sequence_parallel_linear(x, self.weight, bias, self.tp_group)
        else:
            y = linear(copy_to_tensor_model_parallel_region(x, self.tp_group), self.weight, bias)
        y = adapted(self, x_in, y)
        if self.skip_bias_add:
            return y, None if self.bias is None else self.bias.flatten()
        return gather_from_tensor_model_parallel_region(y, self.tp_group) if self.gather_output else y

    # The pieces' communication seam (``ptdp.parallel.pipeline.program.Seam``): a cut layer cuts at the input region
    def entry(self) -> Transfer | None:
        """The input's ``f`` (or the sequence all-gather) as an asynchronous transfer; None where nothing
        is communicated (t = 1) or the linear is not cut (FP8 GEMM, a gathered output, a LoRA adapter: it
        reads the input before the entry)."""
        if group_size(self.tp_group) == 1 or self.fp8_linear is not None or self.gather_output or self.adapter is not None:
            return None
        return GatherSequence(self.tp_group) if self.sequence_parallel else CopyToRegion(self.tp_group)

    def exit(self) -> Transfer | None:
        return None

    def local(self, x: torch.Tensor):
        """The GEMM of the entered (under sequence parallelism: gathered) input. Under sequence parallelism
        the GEMM then keeps the gathered input for its backward (the plain forward keeps the shard)."""
        y = linear(x, self.weight, None if self.skip_bias_add else self.bias)
        return (y, None if self.bias is None else self.bias.flatten()) if self.skip_bias_add else y

    def after(self, y):
        return y


class RowParallelLinear(nn.Module):
    """Y = X A with A split by rows: each rank multiplies its slice of the input features, then ``g``.

    The bias is added once, after the reduction (it is replicated, not split). With
    ``sequence_parallel`` the reduction is a reduce-scatter along the sequence instead of an all-reduce.
    ``skip_bias_add`` returns ``(output, bias)`` so the caller can fuse the bias into what follows.
    """

    fp8_linear = None  # the GEMM in FP8 when ``ptdp.parallel.fp8.enable_fp8`` set one
    PARTITION_DIMS = {"weight": -1}  # the input features; the bias is replicated
    SEQUENCE_PARALLEL = ("bias",)  # added after the reduce-scatter: each rank's tokens only

    def __init__(self, input_size: int, output_size: int, *, tp_group=None, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, skip_bias_add: bool = False):
        super().__init__()
        self.tp_group = tp_group
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel
        local_in = _divide(input_size, group_size(tp_group), "input size")
        self.weight = nn.Parameter(torch.empty(output_size, local_in))
        self.bias = nn.Parameter(torch.zeros(output_size)) if bias else None
        self.adapter: nn.Module | None = None  # LoRA (``ptdp.parallel.lora``): its partial sum joins the reduction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        mm = self.fp8_linear or linear
        if group_size(self.tp_group) == 1 and not self.skip_bias_add:
            return adapted(self, x, mm(x, self.weight, self.bias))  # nothing to reduce: the bias joins the GEMM
        y = adapted(self, x, mm(x, self.weight))
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = reduce_from_tensor_model_parallel_region(y, self.tp_group)
        return self.after(y)

    # The pieces' communication seam (``ptdp.parallel.pipeline.program.Seam``): a cut layer cuts at the output's
    # reduction
    def entry(self) -> Transfer | None:
        return None

    def exit(self) -> Transfer | None:
        """``g`` (or the sequence reduce-scatter) as an asynchronous transfer; None at t = 1, under FP8, with a
        LoRA adapter (the layer then runs whole)."""
        if group_size(self.tp_group) == 1 or self.fp8_linear is not None or self.adapter is not None:
            return None
        return ReduceScatterSequence(self.tp_group) if self.sequence_parallel else ReduceFromRegion(self.tp_group)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product, before the reduction."""
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        return (self.fp8_linear or linear)(x, self.weight)

    def after(self, y: torch.Tensor):
        """The bias, once, after the reduction (or returned beside the output: ``skip_bias_add``)."""
        if self.skip_bias_add:
            return y, self.bias
        return add_bias(y, self.bias)


class HeadSharedInput(nn.Module):
    """A tensor every one of this rank's heads reads whole (multi-latent attention's RoPE key): the same
    tensor forward, its gradient summed over the tensor-parallel ranks' heads backward (``f``); under
    sequence parallelism it arrives split along the sequence and is all-gathered (backward: reduce-scatter,
    which sums the ranks' heads too)."""

    def __init__(self, tp_group=None, sequence_parallel: bool = False):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel  # decided by the plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(x, self.tp_group)
        return copy_to_tensor_model_parallel_region(x, self.tp_group)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; each rank looks up the ids it owns, then ``g`` sums."""

    PARTITION_DIMS = {"weight": 0}
    SEQUENCE_PARALLEL: tuple[str, ...] = ()

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group=None):
        super().__init__()
        self.tp_group = tp_group
        local = _divide(num_embeddings, group_size(tp_group), "padded vocabulary size")
        self.vocab_start = group_rank(tp_group) * local
        self.vocab_end = self.vocab_start + local
        self.weight = nn.Parameter(torch.empty(local, embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.tp_group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(out, self.tp_group)


class VocabParallelLogits(nn.Module):
    """Logits of this rank's V/t vocabulary rows (the output weight is split like the embedding): enter the
    tensor-parallel region (``f``, or the sequence-parallel all-gather), GEMM, mask this slice's padding.
    The loss (``vocab_parallel_cross_entropy``) never gathers the full logits."""

    def __init__(self, vocab_size: int, *, tp_group=None, sequence_parallel: bool = False,
                 softcap: float | None = None):
        super().__init__()
        self.vocab_size, self.tp_group = vocab_size, tp_group
        self.sequence_parallel, self.softcap = sequence_parallel, softcap

    def forward(self, x: torch.Tensor, weight: torch.Tensor, shared: bool) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group)
        else:
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)
        gemm = F.linear if shared else linear  # see ``ptdp.models.layers.Logits``
        logits = mask_padding_(gemm(x, weight), self.vocab_size, group_rank(self.tp_group) * weight.shape[0])
        return logits if self.softcap is None else softcap_logits(logits, self.softcap)  # elementwise: per shard
