"""The one door to ``torch.distributed``'s communication: every collective and point-to-point call ptdp
makes goes through a function here, which records it in the flight recorder just before issuing it.

A hang inside a call made here is therefore visible: the hang watchdog's report names the last recorded
operation (kind, group, peer, shapes, ``action``: what the call is for), the communication counter moved
when it was issued, and a main thread blocked in this module counts as waiting in communication
(``ptdp.observability.liveness``). ``tests/codebase/test_architecture.py`` fails on a ``torch.distributed``
collective or point-to-point call anywhere else in ptdp (process-group management -- ``new_group``,
``get_rank``, ``get_world_size``, ``init_process_group`` ... -- is not communication and stays direct).

Why below ``ptdp.parallel``: the flight recorder lives in ``ptdp.observability``, the lowest layer every
other one may import, and so do collectives of its own (the straggler report's gather, the timeline's
barrier). The tensor-parallel operators of ``ptdp.parallel.collectives`` are built on this door.

The semantics are torch's, call for call: ``group=None`` is the default (world) group, not "no
parallelism" as in ``ptdp.parallel.collectives``; ``async_op=True`` returns the work handle (the caller
waits on it), else ``None``. The torch function is looked up when called, so a test that replaces or
hides one (``dist.batch_isend_irecv``, ``dist.all_gather_single``) sees every call ptdp makes.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ptdp.observability import flight_recorder

Work = Any  # a torch.distributed Work handle (``async_op=True``), or None


# ----------------------------------------------------------------------------------------- collectives


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, group=None,
               async_op: bool = False, action: str | None = None) -> Work:
    """``tensor`` := its reduction (``op``) over ``group``, in place."""
    flight_recorder.record("all_reduce", group=group, tensor=tensor, action=action)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, group=None,
           async_op: bool = False, action: str | None = None) -> Work:
    """The reduction of ``tensor`` over ``group`` into global rank ``dst``'s ``tensor``."""
    flight_recorder.record("reduce", group=group, peer=dst, tensor=tensor, action=action)
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False, action: str | None = None) -> Work:
    """Global rank ``src``'s ``tensor`` into every rank's ``tensor``."""
    flight_recorder.record("broadcast", group=group, peer=src, tensor=tensor, action=action)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None, async_op: bool = False,
               action: str | None = None) -> Work:
    """``tensor_list[r]`` := rank r's ``tensor`` (ranks of ``group``, in order)."""
    flight_recorder.record("all_gather", group=group, tensor=tensor, action=action)
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False,
                      action: str | None = None) -> Work:
    """``output`` := the group's ``input`` tensors concatenated along dim 0 (one flat collective).

    torch >= 2.10 names it ``all_gather_single``; older versions (the package supports torch >= 2.4) only
    have ``all_gather_into_tensor``. Looked up at call time, so every caller (TP, ZeRO-1) shares the
    fallback and a test can hide the new name.
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    flight_recorder.record("all_gather", group=group, tensor=input, action=action)
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False,
                          action: str | None = None) -> Work:
    """``output`` := this rank's 1/n slice (dim 0) of the sum of the group's ``input``; see all_gather_single."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    flight_recorder.record("reduce_scatter", group=group, tensor=input, action=action)
    return fn(output, input, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group=None, async_op: bool = False,
                      action: str | None = None) -> Work:
    """Rank r's ``output`` := the pieces of every rank's ``input`` meant for r (dim 0, split by the sizes;
    equal pieces when omitted), in rank order. The record keeps what this rank sends (``input``)."""
    flight_recorder.record("all_to_all", group=group, tensor=input, action=action)
    return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group,
                                  async_op=async_op)


def all_gather_object(object_list: list, obj: object, group=None, action: str | None = None) -> None:
    """``object_list[r]`` := rank r's picklable ``obj`` (blocking)."""
    flight_recorder.record("all_gather_object", group=group, action=action)
    dist.all_gather_object(object_list, obj, group=group)


def barrier(group=None, async_op: bool = False, action: str | None = None) -> Work:
    """Every rank of ``group`` reached this call."""
    flight_recorder.record("barrier", group=group, action=action)
    return dist.barrier(group=group, async_op=async_op)


def monitored_barrier(group=None, timeout: timedelta | None = None, action: str | None = None) -> None:
    """:func:`barrier` that names the ranks which did not arrive within ``timeout`` (gloo only)."""
    flight_recorder.record("monitored_barrier", group=group, action=action)
    dist.monitored_barrier(group=group, timeout=timeout)


def managed_all_reduce(manager: Any, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                       action: str | None = None) -> Work:
    """``tensor`` := its reduction over the replica groups of the current quorum, through torchft's
    ``Manager.allreduce`` (``--fault-tolerant-replicas``; its process group is torchft's, reconfigured at each
    quorum, so the record names no group). Never raises: an error (a lost group, a timeout) is kept by the
    manager and fails the step's commit. Returns the work to wait on."""
    flight_recorder.record("managed_all_reduce", tensor=tensor, action=action)
    return manager.allreduce(tensor, reduce_op=op)


# ---------------------------------------------------------------------------------------- point to point


def isend(tensor: torch.Tensor, dst: int, group=None, action: str | None = None) -> Work:
    """Start sending ``tensor`` to global rank ``dst``; returns the work to wait on."""
    flight_recorder.record("isend", group=group, peer=dst, tensor=tensor, action=action)
    return dist.isend(tensor, dst, group)


def irecv(tensor: torch.Tensor, src: int, group=None, action: str | None = None) -> Work:
    """Start receiving global rank ``src``'s tensor into ``tensor``; returns the work to wait on."""
    flight_recorder.record("irecv", group=group, peer=src, tensor=tensor, action=action)
    return dist.irecv(tensor, src, group)


def send_op(tensor: torch.Tensor, peer: int, group=None) -> dist.P2POp:
    """A send of ``tensor`` to global rank ``peer``, for :func:`batch_isend_irecv` (issues nothing)."""
    return dist.P2POp(dist.isend, tensor, peer, group)


def recv_op(tensor: torch.Tensor, peer: int, group=None) -> dist.P2POp:
    """A receive from global rank ``peer`` into ``tensor``, for :func:`batch_isend_irecv` (issues nothing)."""
    return dist.P2POp(dist.irecv, tensor, peer, group)


def batch_isend_irecv(ops: Sequence[dist.P2POp], group=None, action: str | None = None) -> list:
    """Post ``ops`` (:func:`send_op`, :func:`recv_op`) together; returns their works (NCCL coalesces them
    into one, gloo gives one per op). ``group``: what the record names (default: the first op's)."""
    if group is None and ops:
        group = ops[0].group
    flight_recorder.record("batch_isend_irecv", group=group, peer=[op.peer for op in ops],
                           tensor=[op.tensor for op in ops], action=action)
    return dist.batch_isend_irecv(list(ops))
