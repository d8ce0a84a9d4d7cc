"""Distributed Newton–Schulz: each matrix orthogonalised once, whole, on one rank; the work spread by FLOPs.

Newton–Schulz needs a whole matrix, but a rank holds a piece of it: its tensor-parallel slice (placement
``Split`` over ``tp``/``etp``), and of that, under ZeRO, only its data-parallel shard (the reducer's bucket
shard, ``Bucket.shard_start:shard_end`` over ``GradReducer.group_of(bucket)``). The ranks that hold pieces of
the same matrices form a grid, T tensor-parallel ranks by D data-parallel ranks (per pipeline stage; for the
experts, the expert-tensor by expert-data-parallel ranks of one expert-parallel index). Each unit
(``ptdp.optim.muon_units``) gets an owner in that grid, chosen by the longest-processing-time rule on its
Newton–Schulz FLOPs, 2·steps·(2mn² + n³) (docs/references.md, §Muon), so each of the T·D ranks does about
1/(T·D) of the work whatever the mix of shapes. One step of a grid (:meth:`Exchange.orthogonalize`):

1. ``dp gather``: on every TP rank, the D data-parallel ranks send their shard of each unit's input to the
   unit's data-parallel owner, which then holds its TP slice whole (nothing to send when the buckets are not
   sharded: every rank holds the whole slice);
2. ``tp gather``: at each data-parallel index, the T tensor-parallel ranks send their slices to the unit's
   owner, which concatenates them into the full matrix (nothing when the unit is replicated over TP);
3. the owner orthogonalises (per matrix of the unit) and scales;
4. ``tp scatter`` and 5. ``dp scatter``: the reverse, each rank receiving exactly the range it holds (the
   whole slice when not sharded: the owner's result is then broadcast, the all-gather of the update).

Each of the four exchanges is one ``all_to_all_single`` over its group (a unit's pieces concatenated in one
order every member derives from the same plan), issued whenever the group has more than one rank, empty or
not, and the grids in a fixed order (dense, then experts): every rank of a group issues the same sequence of
collectives, outside the pipeline schedule (after ``finish_grad_sync``, the norm and clipping), which is
what ``ptdp.simulate.nccl.optimizer`` plays under the NCCL model (``COLLECTIVES``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ptdp.observability import communication
from ptdp.optim.muon_units import Unit
from ptdp.parallel.collectives import group_rank, group_size

# The collectives of one grid's step, in order: (group kind, what). ``ptdp.simulate.nccl.optimizer`` reads it.
COLLECTIVES = (("dp", "muon_dp_gather"), ("tp", "muon_tp_gather"), ("tp", "muon_tp_scatter"), ("dp", "muon_dp_scatter"))
ROLES = ("dense", "expert")  # the grids' order: the same on every rank


@dataclass(frozen=True)
class Shards:
    """How a parameter's elements lie over its data-parallel group: it starts at ``offset`` in a bucket cut
    into ``count`` shards of ``size`` elements (shard k: ``[k·size, (k+1)·size)``); ``count`` 1: every rank
    holds all of it."""

    offset: int
    size: int
    count: int

    def held(self, index: int, numel: int) -> tuple[int, int]:
        """``[lo, hi)`` of ``param.view(-1)`` that data-parallel rank ``index`` holds (possibly empty)."""
        if self.count == 1:
            return 0, numel
        lo = min(max(index * self.size - self.offset, 0), numel)
        return lo, max(lo, min((index + 1) * self.size - self.offset, numel))


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    lo = max(a[0], b[0])
    return lo, max(lo, min(a[1], b[1]))


def assign_owners(units: Sequence[Unit], slots: int, steps: int) -> list[int]:
    """Each unit's slot in ``range(slots)`` (slot = dp_index·T + tp_index): the largest unit first onto the
    least-loaded slot (ties: the unit's order, the lowest slot), so every rank derives the same answer."""
    load = [0.0] * slots
    owner = [0] * len(units)
    for k in sorted(range(len(units)), key=lambda k: (-units[k].flops(steps), k)):
        slot = min(range(slots), key=lambda s: (load[s], s))
        owner[k] = slot
        load[slot] += units[k].flops(steps)
    return owner


class Grid:
    """The units of one role over a T×D grid of ranks, and this rank's place in it."""

    def __init__(self, units: list[Unit], shards: dict[nn.Parameter, Shards], tp_group, dp_group, steps: int):
        self.units = sorted(units, key=lambda u: u.name)  # one order on every rank of the grid
        self.shards, self.tp_group, self.dp_group = shards, tp_group, dp_group
        self.T, self.i = group_size(tp_group), group_rank(tp_group)
        self.D, self.j = group_size(dp_group), group_rank(dp_group)
        owners = assign_owners(self.units, self.T * self.D, steps)
        self.owner = {u.name: divmod(slot, self.T) for u, slot in zip(self.units, owners, strict=True)}  # (j, i)

    def held(self, u: Unit, j: int) -> tuple[int, int]:
        """The part of ``u`` (``param.view(-1)`` coordinates) that data-parallel rank ``j`` holds."""
        return _overlap((u.start, u.end), self.shards[u.param].held(j, u.param.numel()))

    def sharded(self, u: Unit) -> bool:
        return self.shards[u.param].count > 1


def _all_to_all(group, size: int, sends: list[list[torch.Tensor]], recv: list[int], action: str,
                device: torch.device) -> list[torch.Tensor]:
    """One ``all_to_all_single`` over ``group``: ``sends[r]`` concatenated to rank r, ``recv[r]`` elements
    from it; the received pieces per source rank."""
    if size == 1:
        return [torch.empty(0, device=device)]
    flat = [t.reshape(-1) for seg in sends for t in seg]
    inp = torch.cat(flat) if flat else torch.empty(0, device=device)
    out = torch.empty(sum(recv), device=device)
    communication.all_to_all_single(out, inp, recv, [sum(t.numel() for t in seg) for seg in sends], group,
                                    action=action)
    return list(out.split(recv))


class Exchange:
    """Orthogonalises every unit of this rank's grids once and hands each rank the update of what it holds."""

    def __init__(self, grids: list[Grid], orthogonalize: Callable[[torch.Tensor, Unit], torch.Tensor],
                 device: torch.device):
        self.grids, self.orthogonalize_unit, self.device = grids, orthogonalize, device

    def orthogonalize(self, inputs: dict[nn.Parameter, tuple[int, torch.Tensor]]) -> dict[nn.Parameter, torch.Tensor]:
        """``inputs[param] = (lo, x)``: this rank's elements ``[lo, lo + len(x))`` of the update input of a
        parameter it holds; returns the scaled orthogonalised update over the same ranges. Collective over
        every grid's groups: every rank calls it each step, holding pieces or not."""
        out = {p: torch.empty_like(x) for p, (_, x) in inputs.items()}
        for grid in self.grids:
            self._grid(grid, inputs, out)
        return out

    def _piece(self, inputs, p: nn.Parameter, r: tuple[int, int]) -> torch.Tensor:
        lo, x = inputs[p]
        return x[r[0] - lo:r[1] - lo]

    def _grid(self, g: Grid, inputs, out) -> None:
        mine = [u for u in g.units if g.owner[u.name][0] == g.j]  # units whose data-parallel owner is this rank
        # 1. dp gather: this rank's TP slice of each of its units, whole
        local: dict[str, torch.Tensor] = {}
        sends: list[list[torch.Tensor]] = [[] for _ in range(g.D)]
        recv, places = [0] * g.D, []
        for u in g.units:
            j_owner = g.owner[u.name][0]
            held = g.held(u, g.j)
            if j_owner == g.j:
                buf = local[u.name] = torch.empty(u.numel, device=self.device)
                if held[1] > held[0]:
                    buf[held[0] - u.start:held[1] - u.start] = self._piece(inputs, u.param, held)
                for j in range(g.D) if g.sharded(u) else ():
                    if j != g.j:
                        r = g.held(u, j)
                        recv[j] += r[1] - r[0]
                        places.append((j, buf[r[0] - u.start:r[1] - u.start]))
            elif g.sharded(u) and held[1] > held[0]:
                sends[j_owner].append(self._piece(inputs, u.param, held))
        self._place(_all_to_all(g.dp_group, g.D, sends, recv, "muon_dp_gather", self.device), places)
        # 2. tp gather: the full unit on its owner
        sends, recv, pieces = [[] for _ in range(g.T)], [0] * g.T, {}
        for u in mine:
            i_owner = g.owner[u.name][1]
            if u.split_dim is None:
                continue
            if i_owner == g.i:
                recv = [n + (u.numel if i != g.i else 0) for i, n in enumerate(recv)]
                pieces[u.name] = [None if i == g.i else i for i in range(g.T)]
            else:
                sends[i_owner].append(local[u.name])
        got = _all_to_all(g.tp_group, g.T, sends, recv, "muon_tp_gather", self.device)
        cursor = [0] * g.T
        # 3. orthogonalise what this rank owns; 4. tp scatter its slices back
        sends, recv, results = [[] for _ in range(g.T)], [0] * g.T, {}
        for u in mine:
            i_owner = g.owner[u.name][1]
            if i_owner != g.i:
                if g.T > 1:
                    recv[i_owner] += u.numel
                continue
            slices = []
            for i in range(g.T) if u.split_dim is not None else ():
                if i == g.i:
                    slices.append(local[u.name].view(u.local_shape))
                else:
                    slices.append(got[i][cursor[i]:cursor[i] + u.numel].view(u.local_shape))
                    cursor[i] += u.numel
            full = torch.cat(slices, u.split_dim) if slices else local[u.name].view(u.local_shape)
            update = self.orthogonalize_unit(full, u)
            if u.split_dim is None:
                results[u.name] = update.reshape(-1)
                for i in range(g.T):
                    if i != g.i:
                        sends[i].append(update)
            else:
                parts = update.chunk(g.T, u.split_dim)
                results[u.name] = parts[g.i].reshape(-1)
                for i in range(g.T):
                    if i != g.i:
                        sends[i].append(parts[i].contiguous())
        got = _all_to_all(g.tp_group, g.T, sends, recv, "muon_tp_scatter", self.device)
        cursor = [0] * g.T
        for u in mine:
            i_owner = g.owner[u.name][1]
            if i_owner != g.i:
                results[u.name] = got[i_owner][cursor[i_owner]:cursor[i_owner] + u.numel]
                cursor[i_owner] += u.numel
        # 5. dp scatter: each rank its held range of every unit
        sends, recv, places = [[] for _ in range(g.D)], [0] * g.D, []
        for u in g.units:
            j_owner = g.owner[u.name][0]
            held = g.held(u, g.j)
            if held[1] > held[0]:
                lo = inputs[u.param][0]
                dest = out[u.param][held[0] - lo:held[1] - lo]
            if j_owner == g.j:
                result = results[u.name]
                if held[1] > held[0]:
                    dest.copy_(result[held[0] - u.start:held[1] - u.start])
                for j in range(g.D):
                    if j != g.j:
                        r = g.held(u, j)
                        sends[j].append(result[r[0] - u.start:r[1] - u.start])
            elif held[1] > held[0]:
                recv[j_owner] += held[1] - held[0]
                places.append((j_owner, dest))
        self._place(_all_to_all(g.dp_group, g.D, sends, recv, "muon_dp_scatter", self.device), places)

    @staticmethod
    def _place(got: list[torch.Tensor], places: list[tuple[int, torch.Tensor]]) -> None:
        """Copy each source's received run into its destinations, in the order they were planned."""
        cursor = [0] * len(got)
        for source, dest in places:
            n = dest.numel()
            dest.copy_(got[source][cursor[source]:cursor[source] + n].view_as(dest))
            cursor[source] += n
