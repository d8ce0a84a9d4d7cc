"""Token dispatchers of expert parallelism: move each (token, choice) pair to the rank holding its expert.

Both implement the MoE layer's dispatcher seam (``ptdp.models.moe``'s ``LocalDispatcher``)::

    dispatch(hidden [T, h], probs [T, k], indices [T, k]) -> (expert_input [N, h], tokens_per_expert [E/e], ctx)
    combine(expert_output [N, h], ctx) -> [T, h]      # Σ_k probs · expert output, per token
    (each the composition of the phases prepare / dispatch transfer / arrive, depart / combine transfer / finish)

``expert_input`` holds this rank's experts' tokens sorted by local expert; ``combine`` weights by the router
probabilities and sums the k choices of each token, so a layer behaves exactly as with one process.

* ``AllToAllDispatcher`` (Megatron-Core's ``alltoall``): sort the pairs by expert (hence by destination
  rank), exchange the per-expert counts with one all-to-all, then the tokens with a second (uneven splits),
  and sort the received tokens by local expert; ``combine`` reverses each step. Volume: the routed tokens.
* ``AllGatherDispatcher`` (``allgather``): all-gather tokens, probabilities and choices over the expert-
  parallel group, keep the pairs routed to this rank's experts; ``combine`` scatters the weighted outputs
  into a ``[e·T, h]`` buffer and reduce-scatters it. Volume: every token to every rank; no count exchange.

The expert-parallel communication is the dispatcher's two *transfers* (``ptdp.models.moe.Dispatcher``): the
dispatch (all-to-all of the routed rows, or the all-gather of tokens, probabilities and choices) and the
combine (all-to-all back, or a reduce-scatter), each with its transpose for the gradients, issued
asynchronously (``async_op``: a gloo work handle on the CPU; on a GPU NCCL's stream of the group, which the
compute stream waits on only at ``Works.wait``). The MoE layer's forward runs them inside autograd at once;
the overlapped schedules (``ptdp.parallel.pipeline.overlap``) issue them between pieces and wait only where
the result is needed, while another microbatch's piece computes. The tensor-parallel slicing around them
(the all-gather/reduce-scatter and split/all-gather pairs of ``ptdp.parallel.collectives``, along the token
rows, dim 0) stays inside the pieces, synchronous. When the tokens are replicated
over attention's tensor-parallel group (t > 1 without sequence parallelism) each TP rank first keeps its own
1/t of them (backward: all-gather) and the combined output is all-gathered (backward: keep the slice), so
every token meets its experts exactly once and expert gradients are not counted t times.

With expert tensor parallelism (``etp = t``: the expert-tensor group *is* the tensor-parallel group) each
rank's experts hold a 1/t slice of the expert FFN, like the dense MLP's column- then row-parallel linears.
Without sequence parallelism the group's ranks hold the same tokens: they enter through Megatron's ``f``
(their gradients, partial per slice, are summed over the group) and the combined output leaves through ``g``
(the partial products summed). With sequence parallelism each rank holds s/t of them and routes its own
(router and load-balancing loss as with ``etp = 1``); as Megatron-Core does, the routed tokens, probabilities
and choices are all-gathered over the group before the dispatch (backward: reduce-scatter, which sums the
partial gradients) and the combined output is reduce-scattered back to each rank's s/t tokens (backward:
all-gather) -- the ``f``/``g`` pair of sequence parallelism's MLP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ptdp.models.moe import Dispatcher, Local
from ptdp.models.pieces import Transfer
from ptdp.observability import communication
from ptdp.parallel.collectives import (
    all_gather,
    all_gather_single,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    group_rank,
    group_size,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_single,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    split,
)


class AllToAllTransfer:
    """Rows split by ``send`` counts to the group's ranks, rows received per ``recv`` counts; the backward
    runs the transpose (the splits swapped). Issued asynchronously: a gloo work handle on the CPU, NCCL's
    stream of the group on a GPU; the :class:`Works` is waited on by the piece that needs the rows."""

    def __init__(self, group, send: list[int], recv: list[int], what: str) -> None:
        self.group, self.send, self.recv, self.what = group, send, recv, what

    def start(self, tensors: tuple) -> Works:
        return _all_to_all_async(tensors[0], self.group, self.send, self.recv, self.what)

    def start_backward(self, grads: tuple) -> Works:
        return _all_to_all_async(grads[0], self.group, self.recv, self.send, f"{self.what}-grad")


def _all_to_all_async(x: torch.Tensor, group, send: list[int], recv: list[int], what: str) -> Works:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    work = communication.all_to_all_single(out, x.contiguous(), recv, send, group, async_op=True, action=what)
    return Works([work], (out,))


class GatherTransfer:
    """The expert-parallel group's tensors concatenated along dim 0 (all-gather); the backward reduce-
    scatters the gradients of those that carry one (``None`` elsewhere: the routing choices)."""

    def __init__(self, group) -> None:
        self.group, self.size = group, group_size(group)

    def start(self, tensors: tuple) -> Works:
        outs, works = [], []
        for x in tensors:
            flat = torch.empty(self.size * x.numel(), dtype=x.dtype, device=x.device)
            works.append(all_gather_single(flat, x.contiguous().view(-1), group=self.group, async_op=True))
            outs.append(flat.view(self.size * x.shape[0], *x.shape[1:]))
        return Works(works, tuple(outs))

    def start_backward(self, grads: tuple) -> Works:
        return _reduce_scatter_async(grads, self.group, self.size)


class ScatterTransfer:
    """The sum over the group, each rank keeping its 1/e of the rows (reduce-scatter); backward all-gather."""

    def __init__(self, group) -> None:
        self.group, self.size = group, group_size(group)

    def start(self, tensors: tuple) -> Works:
        return _reduce_scatter_async(tensors, self.group, self.size)

    def start_backward(self, grads: tuple) -> Works:
        return GatherTransfer(self.group).start(grads)


def _reduce_scatter_async(tensors: tuple, group, size: int) -> Works:
    outs, works = [], []
    for x in tensors:
        if x is None:
            outs.append(None)
            continue
        out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
        works.append(reduce_scatter_single(out, x.contiguous(), group=group, async_op=True))
        outs.append(out)
    return Works(works, tuple(outs))


@dataclass
class Works:
    """Collectives in flight and the tensors they fill; ``wait`` once, then read (``ptdp.models.pieces``)."""

    works: list
    result: tuple

    def wait(self) -> tuple:
        for work in self.works:
            work.wait()
        self.works = []
        return self.result


def sort_by_expert(indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order, token_of_pair, counts)``: the routed (token, choice) pairs sorted stably by expert, the token
    each sorted pair came from, and the pairs per expert ``[num_experts]``. Pairs a capacity factor dropped
    (index ``num_experts``, ``ptdp.models.moe``) are left out (one host sync: the number of rows)."""
    flat = indices.reshape(-1)
    k = indices.shape[-1] if indices.dim() > 1 else 1
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1)
    dropped = int(counts[num_experts]) if counts.numel() > num_experts else 0
    order = order[:flat.numel() - dropped]
    token = torch.div(order, k, rounding_mode="floor")
    return order, token, counts[:num_experts]


@dataclass
class _Context:
    """What the pieces of one dispatch share that carries no gradient (``Dispatcher``'s ``ctx``)."""

    token: torch.Tensor | None  # the token of each sorted pair (allgather: set on arrival)
    num_tokens: int  # rows of the weighted sum: T of this rank (allgather: of the group)
    counts: torch.Tensor | None = None  # pairs per local expert when nothing is exchanged
    send: list[int] | None = None  # all-to-all: pairs to / from each rank
    recv: list[int] | None = None
    received: torch.Tensor | None = None  # all-to-all: [e, E/e] pairs from each rank per local expert


class _Dispatcher(Dispatcher):
    """The tensor-parallel slicing and the weighted sum shared by both dispatchers."""

    def __init__(self, num_experts: int, ep_group, token_group=None, etp_group=None, sequence_parallel: bool = False):
        self.num_experts = num_experts
        self.ep_group, self.token_group, self.etp_group = ep_group, token_group, etp_group
        # etp > 1 with sequence parallelism: the expert-tensor ranks hold different tokens (module docstring)
        self.gather_tokens = sequence_parallel and group_size(etp_group) > 1
        self.ep_size, self.ep_rank = group_size(ep_group), group_rank(ep_group)
        if num_experts % self.ep_size:
            raise ValueError(f"{num_experts} experts do not split over {self.ep_size} expert-parallel ranks")
        self.local_experts = num_experts // self.ep_size

    def _slice(self, hidden: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor):
        if self.gather_tokens:  # SP + expert tensor parallelism: every rank's tokens to the whole group
            return (gather_from_sequence_parallel_region(hidden, self.etp_group, dim=0),
                    gather_from_sequence_parallel_region(probs, self.etp_group, dim=0),
                    all_gather(indices.contiguous(), self.etp_group, dim=0))
        if group_size(self.etp_group) > 1:  # expert tensor parallelism: Megatron's f on the tokens and weights
            hidden = copy_to_tensor_model_parallel_region(hidden, self.etp_group)
            probs = copy_to_tensor_model_parallel_region(probs, self.etp_group)
        if group_size(self.token_group) == 1:
            return hidden, probs, indices
        return (scatter_to_sequence_parallel_region(hidden, self.token_group, dim=0),
                scatter_to_sequence_parallel_region(probs, self.token_group, dim=0),
                split(indices, self.token_group, dim=0))

    def _unslice(self, out: torch.Tensor) -> torch.Tensor:
        if self.gather_tokens:  # the partial products summed, each rank keeping its own s/t tokens
            return reduce_scatter_to_sequence_parallel_region(out, self.etp_group, dim=0)
        if group_size(self.etp_group) > 1:  # each expert-tensor rank summed its f-slice's partial outputs: g
            out = reduce_from_tensor_model_parallel_region(out, self.etp_group)
        return gather_from_tensor_model_parallel_region(out, self.token_group, dim=0)

    @staticmethod
    def _weighted_sum(rows: torch.Tensor, weights: torch.Tensor, ctx: _Context) -> torch.Tensor:
        """Σ over each token's k choices of probability × expert output, ``[T, h]``."""
        weighted = rows * weights.unsqueeze(-1).to(rows.dtype)
        out = rows.new_zeros((ctx.num_tokens, rows.shape[-1]))
        return out.index_add(0, ctx.token, weighted)


class AllToAllDispatcher(_Dispatcher):
    """Megatron-Core's ``--moe-token-dispatcher-type alltoall`` (module docstring)."""

    def prepare(self, hidden: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor):
        hidden, probs, indices = self._slice(hidden, probs, indices)
        e, local = self.ep_size, self.local_experts
        order, token, counts = sort_by_expert(indices, self.num_experts)
        ctx = _Context(token, hidden.shape[0], counts=counts)
        if e > 1:
            ctx.received = _counts_all_to_all(counts, self.ep_group)  # [e, local] from each source, per expert
            ctx.send = counts.view(e, local).sum(1).tolist()
            ctx.recv = ctx.received.sum(1).tolist()
        return (hidden[token],), (probs.reshape(-1)[order],), ctx  # pairs in expert = destination-rank order

    def dispatch_transfer(self, ctx: _Context) -> Transfer:
        return Local() if ctx.send is None else AllToAllTransfer(self.ep_group, ctx.send, ctx.recv, "moe_dispatch")

    def arrive(self, received: tuple, ctx: _Context):
        rows = received[0]
        if ctx.received is None:
            return rows, ctx.counts, ()
        # Received rows are grouped by source rank, then by local expert: sort them by local expert.
        local = self.local_experts
        expert_of_row = torch.arange(local, device=rows.device).repeat(self.ep_size).repeat_interleave(
            ctx.received.reshape(-1))
        unsort = torch.argsort(expert_of_row, stable=True)
        return rows[unsort], ctx.received.sum(0), (unsort,)

    def depart(self, expert_output: torch.Tensor, carry: tuple, ctx: _Context) -> tuple:
        if not carry:
            return (expert_output,)
        (unsort,) = carry
        return (expert_output.new_empty(expert_output.shape).index_copy(0, unsort, expert_output),)  # source order

    def combine_transfer(self, ctx: _Context) -> Transfer:
        return Local() if ctx.send is None else AllToAllTransfer(self.ep_group, ctx.recv, ctx.send, "moe_combine")

    def finish(self, returned: tuple, keep: tuple, ctx: _Context) -> torch.Tensor:
        return self._unslice(self._weighted_sum(returned[0], keep[0], ctx))


def _counts_all_to_all(counts: torch.Tensor, group) -> torch.Tensor:
    """``[e, E/e]``: how many pairs each rank of the group sends to each of this rank's experts."""
    e = group_size(group)
    out = torch.empty_like(counts)
    communication.all_to_all_single(out, counts.contiguous(), group=group, action="moe_counts")
    return out.view(e, -1)


class AllGatherDispatcher(_Dispatcher):
    """Megatron-Core's ``--moe-token-dispatcher-type allgather`` (module docstring)."""

    def prepare(self, hidden: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor):
        hidden, probs, indices = self._slice(hidden, probs, indices)
        return (hidden, probs, indices.contiguous()), (), _Context(None, hidden.shape[0] * self.ep_size)

    def dispatch_transfer(self, ctx: _Context) -> Transfer:
        return Local() if self.ep_size == 1 else GatherTransfer(self.ep_group)

    def arrive(self, received: tuple, ctx: _Context):
        hidden, probs, indices = received
        first = self.ep_rank * self.local_experts
        flat = indices.reshape(-1)
        mine = ((flat >= first) & (flat < first + self.local_experts)).nonzero().squeeze(-1)
        local = flat[mine] - first
        order = mine[torch.argsort(local, stable=True)]  # this rank's pairs, in local-expert order
        ctx.token = torch.div(order, indices.shape[-1], rounding_mode="floor")
        weights = probs.reshape(-1)[order]
        return hidden[ctx.token], torch.bincount(local, minlength=self.local_experts), (weights,)

    def depart(self, expert_output: torch.Tensor, carry: tuple, ctx: _Context) -> tuple:
        return (self._weighted_sum(expert_output, carry[0], ctx),)  # this rank's experts' part of every token

    def combine_transfer(self, ctx: _Context) -> Transfer:
        return Local() if self.ep_size == 1 else ScatterTransfer(self.ep_group)

    def finish(self, returned: tuple, keep: tuple, ctx: _Context) -> torch.Tensor:
        return self._unslice(returned[0])


DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}
