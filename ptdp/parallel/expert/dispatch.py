"""Token dispatchers of expert parallelism: move each (token, choice) pair to the rank holding its expert.

Both implement the MoE layer's dispatcher seam (``ptdp.models.moe``'s ``LocalDispatcher``)::

    dispatch(hidden [T, h], probs [T, k], indices [T, k]) -> (expert_input [N, h], tokens_per_expert [E/e], ctx)
    combine(expert_output [N, h], ctx) -> [T, h]      # Σ_k probs · expert output, per token

``expert_input`` holds this rank's experts' tokens sorted by local expert; ``combine`` weights by the router
probabilities and sums the k choices of each token, so a layer behaves exactly as with one process.

* ``AllToAllDispatcher`` (Megatron-Core's ``alltoall``): sort the pairs by expert (hence by destination
  rank), exchange the per-expert counts with one all-to-all, then the tokens with a second (uneven splits),
  and sort the received tokens by local expert; ``combine`` reverses each step. Volume: the routed tokens.
* ``AllGatherDispatcher`` (``allgather``): all-gather tokens, probabilities and choices over the expert-
  parallel group, keep the pairs routed to this rank's experts; ``combine`` scatters the weighted outputs
  into a ``[e·T, h]`` buffer and reduce-scatters it. Volume: every token to every rank; no count exchange.

Autograd runs through the collectives (the all-to-all below: its backward is the all-to-all with the splits
swapped; the all-gather/reduce-scatter and split/all-gather pairs are tensor parallelism's operators of
``ptdp.parallel.collectives``, along the token rows, dim 0). When the tokens are replicated
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
import torch.distributed as dist

from ptdp.observability import flight_recorder
from ptdp.parallel.collectives import (
    all_gather,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    group_rank,
    group_size,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    split,
)


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` split by ``send`` counts to the group's ranks; rows received per ``recv`` counts."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, send: list[int], recv: list[int]) -> torch.Tensor:
        ctx.group, ctx.send, ctx.recv = group, send, recv
        return all_to_all(x, group, send, recv)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_to_all(grad.contiguous(), ctx.group, ctx.recv, ctx.send), None, None, None


def all_to_all(x: torch.Tensor, group, send: list[int], recv: list[int]) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    out = x.new_empty((sum(recv), *x.shape[1:]))
    flight_recorder.record("all_to_all", group=group, tensor=x, action="moe_dispatch")
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


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
    order: torch.Tensor  # flat (token, choice) pairs in expert order
    token: torch.Tensor  # the token of each sorted pair
    probs: torch.Tensor  # [pairs] weights in sorted order
    num_tokens: int  # T of this rank (after its tensor-parallel slice)
    send: list[int] | None = None  # all-to-all: pairs to / from each rank
    recv: list[int] | None = None
    unsort: torch.Tensor | None = None  # all-to-all: received rows -> expert order


class _Dispatcher:
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
    def _weighted_sum(rows: torch.Tensor, ctx: _Context) -> torch.Tensor:
        """Σ over each token's k choices of probability × expert output, ``[T, h]``."""
        weighted = rows * ctx.probs.unsqueeze(-1).to(rows.dtype)
        out = rows.new_zeros((ctx.num_tokens, rows.shape[-1]))
        return out.index_add(0, ctx.token, weighted)


class AllToAllDispatcher(_Dispatcher):
    """Megatron-Core's ``--moe-token-dispatcher-type alltoall`` (module docstring)."""

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor):
        hidden, probs, indices = self._slice(hidden, probs, indices)
        e, local = self.ep_size, self.local_experts
        order, token, counts = sort_by_expert(indices, self.num_experts)
        ctx = _Context(order, token, probs.reshape(-1)[order], hidden.shape[0])
        rows = hidden[token]  # pairs in expert order = destination-rank order
        if e == 1:
            return rows, counts, ctx
        received = _counts_all_to_all(counts, self.ep_group)  # [e, local]: from each source, per local expert
        ctx.send = counts.view(e, local).sum(1).tolist()
        ctx.recv = received.sum(1).tolist()
        rows = _AllToAll.apply(rows, self.ep_group, ctx.send, ctx.recv)
        # Received rows are grouped by source rank, then by local expert: sort them by local expert.
        expert_of_row = torch.arange(local, device=rows.device).repeat(e).repeat_interleave(received.reshape(-1))
        ctx.unsort = torch.argsort(expert_of_row, stable=True)
        return rows[ctx.unsort], received.sum(0), ctx

    def combine(self, expert_output: torch.Tensor, ctx: _Context) -> torch.Tensor:
        rows = expert_output
        if ctx.unsort is not None:
            rows = rows.new_empty(rows.shape).index_copy(0, ctx.unsort, rows)  # back to source-rank order
            rows = _AllToAll.apply(rows, self.ep_group, ctx.recv, ctx.send)
        return self._unslice(self._weighted_sum(rows, ctx))


def _counts_all_to_all(counts: torch.Tensor, group) -> torch.Tensor:
    """``[e, E/e]``: how many pairs each rank of the group sends to each of this rank's experts."""
    e = group_size(group)
    out = torch.empty_like(counts)
    flight_recorder.record("all_to_all", group=group, tensor=counts, action="moe_counts")
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out.view(e, -1)


class AllGatherDispatcher(_Dispatcher):
    """Megatron-Core's ``--moe-token-dispatcher-type allgather`` (module docstring)."""

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor):
        hidden, probs, indices = self._slice(hidden, probs, indices)
        num_tokens = hidden.shape[0]
        if self.ep_size > 1:
            hidden = gather_from_sequence_parallel_region(hidden, self.ep_group, dim=0)
            probs = gather_from_sequence_parallel_region(probs, self.ep_group, dim=0)
            indices = all_gather(indices.contiguous(), self.ep_group, dim=0)
        first = self.ep_rank * self.local_experts
        flat = indices.reshape(-1)
        mine = ((flat >= first) & (flat < first + self.local_experts)).nonzero().squeeze(-1)
        local = flat[mine] - first
        order = mine[torch.argsort(local, stable=True)]  # this rank's pairs, in local-expert order
        k = indices.shape[-1]
        token = torch.div(order, k, rounding_mode="floor")
        ctx = _Context(order, token, probs.reshape(-1)[order], hidden.shape[0])
        ctx.send = [num_tokens]  # this rank's own tokens: what combine keeps
        return hidden[token], torch.bincount(local, minlength=self.local_experts), ctx

    def combine(self, expert_output: torch.Tensor, ctx: _Context) -> torch.Tensor:
        out = self._weighted_sum(expert_output, ctx)  # [e·T, h]: this rank's experts' part of every token
        if self.ep_size > 1:
            out = reduce_scatter_to_sequence_parallel_region(out, self.ep_group, dim=0)
        return self._unslice(out)


DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}
