"""The column-parallel linear under sequence parallelism, saving only its *sharded* input for backward.

Korthikanti et al.'s activation saving under sequence parallelism (docs/references.md, §Memory) needs the
QKV and first-MLP linears to keep their input as each rank holds it -- ``s/t`` tokens -- not the
all-gathered ``s`` tokens the GEMM reads. Gathering and then calling a linear makes autograd keep the
gathered tensor (t times the bytes) for the weight gradient. Megatron's
``LinearWithGradAccumulationAndAsyncCommunication`` instead saves the shard and all-gathers it again in
the backward, overlapped with the input-gradient GEMM; this module does the same:

* forward: all-gather the sequence (dim 1 of ``[b, s/t, h]``), GEMM, save the shard;
* backward: launch the all-gather of the saved shard, compute ``dX = dY W`` meanwhile, reduce-scatter
  ``dX`` over the sequence, then the weight gradient from the re-gathered input. Under a zero-bubble
  split (``defer_weight_grads``) the weight gradient waits in the W pass with the *shard*, and the
  all-gather happens there.

The arithmetic is that of gather-then-``weight_grad.linear`` on the same gathered tensor, so losses and
gradients are bit for bit what they were.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ptdp.ops.weight_grad import WeightGrads, deferring_store, plain_path
from ptdp.parallel.collectives import all_gather, all_gather_single, group_size, reduce_scatter

SEQ_DIM = 1  # activations are [b, s, h]


def _gather_start(x: Tensor, group) -> tuple[Tensor, object]:
    flat = torch.empty(group_size(group) * x.numel(), dtype=x.dtype, device=x.device)
    return flat, all_gather_single(flat, x.contiguous().view(-1), group=group, async_op=True)


def _gather_finish(flat: Tensor, handle, shape: torch.Size, world: int) -> Tensor:
    """The rank-major flat buffer as the tensor concatenated along the sequence (as ``all_gather``)."""
    handle.wait()
    if all(n == 1 for n in shape[:SEQ_DIM]):
        return flat.view(*shape[:SEQ_DIM], world * shape[SEQ_DIM], *shape[SEQ_DIM + 1:])
    return torch.cat(flat.view(world, *shape).unbind(0), dim=SEQ_DIM)


def sequence_parallel_linear(x: Tensor, weight: Tensor, bias: Tensor | None, group) -> Tensor:
    """``linear(all_gather(x, seq), weight, bias)`` whose backward keeps only ``x`` (this rank's tokens)."""
    if plain_path():
        full = all_gather(x, group, SEQ_DIM)
        return F.linear(full, weight.flatten(0, -2), None if bias is None else bias.flatten())
    return _SequenceParallelLinear.apply(x, weight, bias, group)


class _SequenceParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, group) -> Tensor:
        ctx.save_for_backward(x, weight)  # the shard: 1/t of what the GEMM reads
        ctx.params, ctx.group = (weight, bias), group
        full = all_gather(x, group, SEQ_DIM)
        return F.linear(full, weight.flatten(0, -2), None if bias is None else bias.flatten())

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        w_param, b_param = ctx.params
        group, world = ctx.group, group_size(ctx.group)
        need_w = ctx.needs_input_grad[1]
        need_b = b_param is not None and ctx.needs_input_grad[2]
        store = deferring_store(w_param, b_param) if (need_w or need_b) else None
        gathering = _gather_start(x, group) if need_w and store is None else None  # overlaps dX below
        dx = None
        if ctx.needs_input_grad[0]:
            dx = reduce_scatter(grad.matmul(weight.flatten(0, -2)), group, SEQ_DIM)

        @torch.no_grad()  # plain tensors, in the backward or in W (autograd.backward lands them)
        def weight_grads() -> WeightGrads:
            g2 = grad.reshape(-1, grad.shape[-1])
            dw = None
            if need_w:
                flat, handle = gathering if gathering is not None else _gather_start(x, group)
                full = _gather_finish(flat, handle, x.shape, world)
                dw = g2.t().mm(full.reshape(-1, full.shape[-1])).view(w_param.shape)
            db = g2.sum(0).view(b_param.shape) if need_b else None
            return [(w_param, dw), (b_param, db)]

        if not (need_w or need_b):
            return dx, None, None, None
        if store is None:
            (_, dw), (_, db) = weight_grads()
            return dx, dw, db, None
        store.add(weight_grads)
        return dx, None, None, None
