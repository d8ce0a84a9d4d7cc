"""The tensor-parallel collectives of a layer as transfers between pieces, issued asynchronously.

Megatron's conjugate pair ``f`` (identity forward, all-reduce backward) / ``g`` (all-reduce forward,
identity backward), and under sequence parallelism the all-gather / reduce-scatter pair along the sequence
(``ptdp.parallel.collectives``), are autograd functions that communicate at once. Run in pieces (the
overlapped forward-and-backward of DualPipeV and combined 1F1B: ``ptdp.models.pieces``), a transformer
layer is cut at them instead (the linears' ``entry`` / ``exit``, ``ptdp.parallel.pipeline.program``):
each becomes an exchange whose :class:`~ptdp.models.pieces.Transfer` here issues the collective with
``async_op=True`` (a gloo work handle on the CPU; NCCL's stream of the group on a GPU) and is waited on only
by the piece that consumes its result, while the other microbatch's piece computes.

The collectives are those of the autograd functions, on the same tensors, so the numbers are the plain
run's: the all-reduces in place on the contiguous tensor, the sequence gathers and reduce-scatters over the
same rank-major flat buffers as ``collectives.all_gather`` / ``reduce_scatter``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ptdp.models.pieces import Done
from ptdp.observability import communication
from ptdp.parallel.collectives import (
    all_gather_single,
    gathered_along,
    group_size,
    rank_major,
    reduce_scatter_single,
)

SEQ_DIM = 1  # activations are [b, s, h]


@dataclass
class Issued:
    """A collective in flight and how to read its result once it completed (``Pending``)."""

    work: object
    finish: object  # () -> the result tuple

    def wait(self) -> tuple:
        self.work.wait()
        return self.finish()


def _all_reduce(tensors: tuple, group) -> Issued:
    x = tensors[0].contiguous()
    return Issued(communication.all_reduce(x, group=group, async_op=True), lambda: (x,))


def _all_gather(tensors: tuple, group, dim: int) -> Issued:
    """``collectives.all_gather`` along ``dim``, the rank-major buffer laid out at ``wait``."""
    x, world = tensors[0], group_size(group)
    flat = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
    work = all_gather_single(flat, x.contiguous().view(-1), group=group, async_op=True)
    return Issued(work, lambda: (gathered_along(flat, x.shape, world, dim),))


def _reduce_scatter(tensors: tuple, group, dim: int) -> Issued:
    """``collectives.reduce_scatter`` along ``dim``."""
    blocks, out = rank_major(tensors[0], group_size(group), dim)
    work = reduce_scatter_single(out.view(-1), blocks.view(-1), group=group, async_op=True)
    return Issued(work, lambda: (out,))


class CopyToRegion:
    """``f``, a column-parallel linear's entry: identity forward, all-reduce of the gradient backward."""

    def __init__(self, group) -> None:
        self.group = group

    def start(self, tensors: tuple) -> Done:
        return Done(tensors)

    def start_backward(self, grads: tuple) -> Issued:
        return _all_reduce(grads, self.group)


class ReduceFromRegion:
    """``g``, a row-parallel linear's exit: all-reduce forward, identity backward."""

    def __init__(self, group) -> None:
        self.group = group

    def start(self, tensors: tuple) -> Issued:
        return _all_reduce(tensors, self.group)

    def start_backward(self, grads: tuple) -> Done:
        return Done(grads)


class GatherSequence:
    """Sequence parallelism's entry: all-gather the sequence forward, reduce-scatter the gradient backward."""

    def __init__(self, group) -> None:
        self.group = group

    def start(self, tensors: tuple) -> Issued:
        return _all_gather(tensors, self.group, SEQ_DIM)

    def start_backward(self, grads: tuple) -> Issued:
        return _reduce_scatter(grads, self.group, SEQ_DIM)


class ReduceScatterSequence:
    """Sequence parallelism's exit: reduce-scatter along the sequence forward, all-gather backward."""

    def __init__(self, group) -> None:
        self.group = group

    def start(self, tensors: tuple) -> Issued:
        return _reduce_scatter(tensors, self.group, SEQ_DIM)

    def start_backward(self, grads: tuple) -> Issued:
        return _all_gather(grads, self.group, SEQ_DIM)
