"""The conjugate communication operators of tensor parallelism, as autograd functions.

Megatron's ``f`` (identity forward, all-reduce backward) enters a tensor-parallel region and ``g``
(all-reduce forward, identity backward) leaves it (paper §2.3, ptdp-facts.md §Communication). Sequence
parallelism (Korthikanti et al.) replaces each all-reduce by an all-gather/reduce-scatter pair along the
sequence dimension. All of them are no-ops for a group of one rank, so a t=1 run costs nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch >= 2.10 renamed the tensor-in/tensor-out collectives; keep both working (torch >= 2.4).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(tensor, group=group)
    return tensor


def all_gather(tensor: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Concatenate the group's tensors along ``dim`` (in rank order)."""
    world = group_size(group)
    if world == 1:
        return tensor
    dim = dim % tensor.dim()
    moved = tensor.movedim(dim, 0).contiguous()
    out = torch.empty((world * moved.shape[0], *moved.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    _all_gather_single(out, moved, group=group)
    return out.movedim(0, dim)


def reduce_scatter(tensor: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Sum over the group and keep this rank's 1/t slice along ``dim``."""
    world = group_size(group)
    if world == 1:
        return tensor
    dim = dim % tensor.dim()
    moved = tensor.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // world, *moved.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    _reduce_scatter_single(out, moved, group=group)
    return out.movedim(0, dim)


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


class _ScatterToRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dimension; gather gradients back."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split(x, group, -1)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, -1), None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather the last dimension; split gradients back."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, group, -1)

    @staticmethod
    def backward(ctx, grad):
        return split(grad, ctx.group, -1), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    """Enter sequence parallelism: keep this rank's slice of the sequence (dim 1 of [b, s, h])."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split(x, group, 1)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, 1), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """Sequence-parallel ``f``: all-gather the sequence forward, reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, group, 1)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.group, 1), None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Sequence-parallel ``g``: reduce-scatter the sequence forward, all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter(x, group, 1)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, 1), None


def _apply(fn, x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else fn.apply(x, group)


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _apply(_CopyToRegion, x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _apply(_ReduceFromRegion, x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _apply(_ScatterToRegion, x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _apply(_GatherFromRegion, x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _apply(_ScatterToSequenceRegion, x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _apply(_GatherFromSequenceRegion, x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _apply(_ReduceScatterToSequenceRegion, x, group)
