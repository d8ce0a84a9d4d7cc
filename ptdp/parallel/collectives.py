"""The conjugate communication operators of tensor parallelism, as autograd functions.

Megatron's ``f`` (identity forward, all-reduce backward) enters a tensor-parallel region and ``g``
(all-reduce forward, identity backward) leaves it (paper §2.3, docs/references.md, §Communication). Sequence
parallelism (Korthikanti et al.) replaces each all-reduce by an all-gather/reduce-scatter pair along the
sequence dimension. All of them are no-ops for a group of one rank, so a t=1 run costs nothing.

Here ``group=None`` means no parallelism (a group of one). The calls themselves go through the door of
``ptdp.observability.communication`` (torch's semantics, each call recorded by the flight recorder).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ptdp.observability import communication

# The flat collectives of the door, re-exported for the parallelisms (TP, ZeRO, recomputation) that use them.
all_gather_single = communication.all_gather_single
reduce_scatter_single = communication.reduce_scatter_single


def group_size(group) -> int:
    """The size of ``group``; 1 for None (no parallelism, in this module's convention)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This rank's index in ``group``; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


def all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` in place (nothing for a group of one rank, or None)."""
    if group_size(group) > 1:
        communication.all_reduce(tensor, group=group)
    return tensor


def all_gather(tensor: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Concatenate the group's tensors along ``dim`` (in rank order); the result is contiguous.

    One flat collective into a rank-major buffer. When every dimension before ``dim`` has size 1 (dim 0,
    or the sequence of a ``[1, s/t, h]`` activation) that buffer already is the concatenation; otherwise
    one ``torch.cat`` lays the blocks out (not a transposing copy before and another after).
    """
    world = group_size(group)
    if world == 1:
        return tensor
    dim = dim % tensor.dim()
    flat = torch.empty(world * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    all_gather_single(flat, tensor.contiguous().view(-1), group=group)
    return gathered_along(flat, tensor.shape, world, dim)


def gathered_along(flat: torch.Tensor, shape: torch.Size, world: int, dim: int) -> torch.Tensor:
    """An all-gather's rank-major flat buffer of ``world`` tensors of ``shape``, laid out along ``dim``: a
    view when the dimensions before ``dim`` have size 1, one ``torch.cat`` otherwise."""
    if all(n == 1 for n in shape[:dim]):
        return flat.view(*shape[:dim], world * shape[dim], *shape[dim + 1:])
    return torch.cat(flat.view(world, *shape).unbind(0), dim=dim)


def reduce_scatter(tensor: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Sum over the group and keep this rank's 1/t slice along ``dim`` (contiguous).

    The input is laid out rank-major for the flat collective: free when the dimensions before ``dim``
    have size 1, one copy otherwise; the output needs no copy.
    """
    world = group_size(group)
    if world == 1:
        return tensor
    blocks, out = rank_major(tensor, world, dim % tensor.dim())
    reduce_scatter_single(out.view(-1), blocks.view(-1), group=group)
    return out


def rank_major(tensor: torch.Tensor, world: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A reduce-scatter's input along ``dim`` laid out rank-major (free when the dimensions before ``dim``
    have size 1, one copy otherwise), and the buffer of this rank's 1/``world`` slice it yields."""
    shape = tensor.shape
    local = shape[dim] // world
    if all(n == 1 for n in shape[:dim]):
        blocks = tensor.contiguous()
    else:
        blocks = tensor.unflatten(dim, (world, local)).movedim(dim, 0).contiguous()
    out = torch.empty((*shape[:dim], local, *shape[dim + 1:]), dtype=tensor.dtype, device=tensor.device)
    return blocks, out


def split(tensor: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """This rank's 1/t slice along ``dim`` (no communication)."""
    world = group_size(group)
    if world == 1:
        return tensor
    return tensor.chunk(world, dim=dim)[group_rank(group)].contiguous()


class _CopyToRegion(torch.autograd.Function):
    """``f``: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """``g``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Conjugate(torch.autograd.Function):
    """``_Conjugate.apply(x, group, dim, forward, backward)``: the collective ``forward`` along ``dim``, whose
    gradient is its adjoint ``backward``: a split's is the all-gather of the slices (the input was the same on
    every rank, so each rank's slice of the gradient completes it); an all-gather's, when its output is used
    alike on every rank, this rank's split, and when each rank used other rows of it (sequence-parallel
    ``f``), the reduce-scatter; a reduce-scatter's (sequence-parallel ``g``), the all-gather."""

    @staticmethod
    def forward(ctx, x, group, dim, forward, backward):
        ctx.group, ctx.dim, ctx.adjoint = group, dim, backward
        return forward(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.adjoint(grad, ctx.group, ctx.dim), None, None, None, None


def _apply(fn, x: torch.Tensor, group, *args) -> torch.Tensor:
    return x if group_size(group) == 1 else fn.apply(x, group, *args)


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _apply(_CopyToRegion, x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _apply(_ReduceFromRegion, x, group)


# The scatter/gather operators default to Megatron's dimensions (the hidden dimension for tensor
# parallelism, the sequence of ``[b, s, h]`` for sequence parallelism); ``dim`` serves the same pairs
# elsewhere: the expert dispatch's token rows (dim 0), context parallelism's sequence of ``[b, a, s, d]``.


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    return _apply(_Conjugate, x, group, dim, split, all_gather)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    return _apply(_Conjugate, x, group, dim, all_gather, split)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    return _apply(_Conjugate, x, group, dim, split, all_gather)


def gather_from_sequence_parallel_region(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    return _apply(_Conjugate, x, group, dim, all_gather, reduce_scatter)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    return _apply(_Conjugate, x, group, dim, reduce_scatter, all_gather)
