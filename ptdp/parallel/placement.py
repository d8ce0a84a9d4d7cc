"""Where each parameter of a rank lives in the full model: one frozen :class:`Placement` per parameter.

Every parallelism that cuts or marks a parameter says so here, once, where it is applied
(``ptdp.parallel.parallelize`` runs the steps): the tensor-parallel layers *declare* which dimension of
each parameter they split (``PARTITION_DIMS`` on ``ColumnParallelLinear`` & co.) and
``apply_tensor_parallel`` records it; ``apply_expert_parallel`` records the experts' rows (and their
expert-tensor split), ``apply_vocab_parallel`` the vocabulary slices, the pipeline split the last stage's
copy of the tied embedding, ``record_weight_decay`` Megatron's decay rule, and the MoE gradient buffers which
rank counts an element in the gradient norm. Everything that must know how a parameter is laid out reads
its record from the one :class:`Placements` registry of the rank (``build_model_chunks`` returns it with the
chunks, ``TrainState.placements`` keeps it): initialisation draws the full tensor and keeps
:meth:`Placement.piece`; checkpoints build their ``DTensor`` views with :func:`to_dtensor` (and the ZeRO
boxes with :meth:`Placement.offset`); clipping asks :meth:`Placement.counts_in_norm`; the gradient
buffers keep vocabulary slices and sequence-parallel parameters apart; the optimizers group by
``weight_decay``; the partial-gradient sync sums the ones ``partial_over`` the TP group. Nothing parallel is set
on ``nn.Parameter`` any more: its ``__dict__`` holds only ``main_grad`` (Megatron's convention), and
``tests/codebase/test_architecture.py`` checks it.

Why a registry of plain records rather than the alternatives:

- Attributes on the parameter (what ptdp had, and Megatron's ``tensor_model_parallel``) are untyped, read
  back by ``getattr`` probing with a default that silently hides a missing mark, and must be copied by
  hand each time a parameter is replaced (materialise, expert slicing, deferred init).
- DTensor parameters would carry placements natively, but every layer, kernel and the flat gradient
  buffers (``param.data`` is a view of a bucket) work on plain local tensors; ptdp only needs DTensors at
  the checkpoint boundary, so :func:`to_dtensor` builds them there from the record.

One :class:`Split` per *mesh dimension*, applied outermost first: a vocabulary slice is
``Split("pp", 0, p, pp_rank)`` then ``Split("tp", 0, t, tp_rank)`` (row block ``pp_rank·t + tp_rank``), not
one ``p·t``-way split, so a record maps one to one onto DTensor's ``[Shard(0), Shard(0)]`` over the
``(pp, tp)`` mesh, and "split over the TP group" (which decides who counts it in the norm) is one test for
every kind of parameter. The axes are the mesh dimension names: ``tp`` and ``pp`` of ``ParallelState.mesh``,
``ep`` and ``etp`` of the expert mesh (``ptdp.parallel.expert.dims``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

Role = Literal["dense", "expert", "vocab", "embedding_copy"]
TP_AXES = ("tp", "etp")  # splits over the ranks of one tensor-parallel group (etp = 1 or t: the same ranks)


@dataclass(frozen=True)
class Split:
    """Dimension ``dim`` of the tensor is cut into ``size`` contiguous equal pieces over mesh dimension
    ``axis``; this rank holds piece ``index``."""

    axis: str
    dim: int
    size: int
    index: int


@dataclass(frozen=True)
class Placement:
    """One parameter of this rank: its full-model (layout-independent) ``name``, the ``splits`` that cut
    the full tensor down to this rank's piece (outermost first), its ``role`` (``embedding_copy``: the last
    stage's copy of the tied embedding, saved and counted once), ``partial_over`` (the mesh axes over which
    the parameter is replicated but each rank's gradient is a partial sum: ``("tp",)`` for a norm that sees
    this rank's tokens under sequence parallelism, or a per-head q/k norm that sees this rank's heads; the
    sums run after the backward, ``ptdp.parallel.sequence.grads``), ``weight_decay``, and ``norm_owner``: set
    when the gradient norm is summed over more than the TP and PP groups (MoE), whether this rank counts it."""

    name: str
    splits: tuple[Split, ...] = ()
    role: Role = "dense"
    partial_over: tuple[str, ...] = ()
    weight_decay: bool = True
    norm_owner: bool | None = None

    def full_shape(self, local: tuple[int, ...] | torch.Size) -> torch.Size:
        """The full parameter's shape, given this rank's piece's."""
        shape = list(local)
        for split in self.splits:
            shape[split.dim] *= split.size
        return torch.Size(shape)

    def offset(self, local: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
        """Where this rank's piece starts in the full parameter, per dimension."""
        shape, offset = list(self.full_shape(local)), [0] * len(local)
        for split in self.splits:
            shape[split.dim] //= split.size
            offset[split.dim] += split.index * shape[split.dim]
        return tuple(offset)

    def piece(self, full: Tensor) -> Tensor:
        """This rank's piece of the full tensor (a view)."""
        for split in self.splits:
            full = full.chunk(split.size, split.dim)[split.index]
        return full

    @property
    def split_over_tp(self) -> bool:
        """Whether the TP ranks hold different pieces (else each holds the same tensor)."""
        return any(split.axis in TP_AXES for split in self.splits)

    def counts_in_norm(self, tp_rank: int) -> bool:
        """Whether this rank's copy counts in the global gradient norm (each element exactly once): a piece
        split over TP on every TP rank, a replicated tensor on TP rank 0, the tied copy nowhere (the
        embedding counts); ``norm_owner`` decides when it is set."""
        if self.norm_owner is not None:
            return self.norm_owner
        return self.role != "embedding_copy" and (self.split_over_tp or tp_rank == 0)


class Placements:
    """The :class:`Placement` of each parameter of one rank (the registry the parallelisms fill in)."""

    def __init__(self) -> None:
        self._records: dict[nn.Parameter, Placement] = {}  # keyed by identity (Tensor hashes by id)

    def __getitem__(self, param: nn.Parameter) -> Placement:
        return self._records[param]

    def get(self, param: nn.Parameter) -> Placement | None:
        return self._records.get(param)

    def __contains__(self, param: object) -> bool:
        return param in self._records

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[nn.Parameter]:
        return iter(self._records)

    def record(self, param: nn.Parameter, placement: Placement) -> None:
        self._records[param] = placement

    def adopt(self, module: nn.Module, name_of: Callable[[str], str] = lambda name: name) -> None:
        """Record every parameter of ``module`` that has none yet as a whole, dense one, under its
        full-model name ``name_of(name in module)``."""
        for name, param in module.named_parameters():
            if param not in self._records:
                self._records[param] = Placement(name_of(name))

    def update(self, param: nn.Parameter, **changes) -> None:
        """Replace ``param``'s record by a copy with ``changes`` (the fields of :class:`Placement`)."""
        self._records[param] = dataclasses.replace(self._records[param], **changes)

    def add_split(self, param: nn.Parameter, split: Split) -> None:
        """``param`` is now this rank's piece of what it was: ``split`` goes inside the earlier ones."""
        self.update(param, splits=(*self._records[param].splits, split))

    def replace(self, old: nn.Parameter, new: nn.Parameter) -> None:
        """``new`` takes ``old``'s place in the model (materialised, sliced, swapped): it keeps the record."""
        self._records[new] = self._records.pop(old)

    def remove(self, module: nn.Module) -> None:
        """``module`` leaves the model: forget its parameters."""
        for param in module.parameters():
            self._records.pop(param, None)

    def counts_in_norm(self, param: nn.Parameter, tp_rank: int) -> bool:
        """:meth:`Placement.counts_in_norm`; a parameter nobody recorded (a plain model) is replicated."""
        placement = self._records.get(param)
        return tp_rank == 0 if placement is None else placement.counts_in_norm(tp_rank)

    def decays(self, param: nn.Parameter) -> bool:
        """Whether AdamW decays ``param``; a parameter nobody recorded by its shape (matrices only)."""
        placement = self._records.get(param)
        return param.dim() >= 2 if placement is None else placement.weight_decay

    def has_role(self, param: nn.Parameter, role: Role) -> bool:
        placement = self._records.get(param)
        return placement is not None and placement.role == role

    def add_partial(self, param: nn.Parameter, axis: str) -> None:
        """``param``'s gradient on this rank is a partial sum over the ranks of mesh dimension ``axis``."""
        partial = self._records[param].partial_over
        if axis not in partial:
            self.update(param, partial_over=(*partial, axis))

    def partial_over(self, param: nn.Parameter, axis: str = "tp") -> bool:
        """Whether ``param``'s gradient is a partial sum over mesh dimension ``axis`` (summed after the backward)."""
        placement = self._records.get(param)
        return placement is not None and axis in placement.partial_over


def to_dtensor(tensor: Tensor, placement: Placement, mesh_for: Callable[[tuple[str, ...]], object]) -> Tensor:
    """``tensor`` (this rank's piece of ``placement``'s parameter, or a tensor shaped like it) as the
    ``DTensor`` of the full one: ``Shard(split.dim)`` per split on the mesh ``mesh_for(axes)`` returns for
    the splits' axes (None: no mesh, a world of one). Returned as it is when nothing is split."""
    from torch.distributed.tensor import DTensor, Shard

    sizes = [split.size for split in placement.splits]
    mesh = mesh_for(tuple(split.axis for split in placement.splits)) if any(s > 1 for s in sizes) else None
    if mesh is None:
        return tensor
    return DTensor.from_local(tensor, mesh, [Shard(split.dim) for split in placement.splits], run_check=False)
