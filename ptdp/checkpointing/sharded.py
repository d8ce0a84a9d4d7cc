"""Checkpoint pieces that no rank holds whole: ZeRO shards written and read as boxes of the global tensor.

The distributed optimizer (and, at stage 3, the model) keeps on each rank only flat ranges of its
TP-local parameters (:class:`~ptdp.optim.optimizer.ShardPiece`). Gathering them into full tensors to
save them -- what the first version did -- costs every rank 12 bytes per parameter of fp32 master
weights and Adam moments, the very memory ZeRO set out to remove. Instead each range is cut into the
few rectangular boxes it covers in the row-major TP-local tensor (at most 2k - 1 for a k-D tensor: a
partial first row, whole rows, a partial last row), shifted by the rank's TP offset into the *global*
tensor's coordinates, and handed to ``torch.distributed.checkpoint`` as chunks of that global tensor.

So the checkpoint holds the same keys and global shapes as ever (a checkpoint written before this loads,
and one written now loads in a layout without sharding): only the chunking differs, and DCP's resharding
reads, for every box a rank of the *new* layout asks for, the overlapping parts of whatever boxes were
saved. Each rank reads exactly what it owns; nothing full-size is built on either side.

:class:`Boxes` is the state-dict value for such a tensor; :class:`BoxSavePlanner` and
:class:`BoxLoadPlanner` teach DCP's default planners about it (DCP only knows tensors, DTensors and
ShardedTensors, none of which can say "these few boxes of a global tensor").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


def flat_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The boxes ``(offsets, sizes, flat start)`` that elements ``[start, end)`` of a row-major tensor of
    ``shape`` make up, in order; each box is a contiguous run of the flat tensor."""
    if start >= end:
        return []
    if len(shape) == 0:
        return [((), (), 0)]
    if len(shape) == 1:
        return [((start,), (end - start,), start)]
    inner = 1
    for n in shape[1:]:
        inner *= n
    out: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []

    def partial(row: int, lo: int, hi: int) -> None:  # part of one row: boxes of the trailing dimensions
        for offsets, sizes, flat in flat_boxes(shape[1:], lo, hi):
            out.append(((row, *offsets), (1, *sizes), row * inner + flat))

    (r0, c0), (r1, c1) = divmod(start, inner), divmod(end, inner)
    if r0 == r1:
        partial(r0, c0, c1)
        return out
    if c0:
        partial(r0, c0, inner)
        r0 += 1
    if r1 > r0:  # whole rows
        out.append(((r0, *(0,) * (len(shape) - 1)), (r1 - r0, *shape[1:]), r0 * inner))
    if c1:
        partial(r1, 0, c1)
    return out


@dataclass
class Boxes:
    """Some boxes of a global tensor: ``chunks[i] = (global offsets, tensor shaped like the box)``.

    The tensors are views into what the rank holds (a save writes them, a load fills them in place).
    """

    shape: torch.Size
    chunks: list[tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=list)

    def at(self, index: MetadataIndex) -> torch.Tensor:
        """The box ``index`` names: by position when DCP passes it (a load's read items do, and two boxes
        of one rank may start at the same place there), else by offsets."""
        if index.index is not None and index.index < len(self.chunks) \
                and tuple(self.chunks[index.index][0]) == tuple(index.offset):
            return self.chunks[index.index][1]
        for where, tensor in self.chunks:
            if tuple(where) == tuple(index.offset):
                return tensor
        raise KeyError(f"{index.fqn}: no box at {tuple(index.offset)}")

    def clone(self) -> Boxes:
        """A private copy (``--async-save`` stages one before training changes the live tensors)."""
        return Boxes(self.shape, [(where, t.detach().clone()) for where, t in self.chunks])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.chunks)


def piece_boxes(flat: torch.Tensor, local_shape: tuple[int, ...], lo: int, tp_offset: tuple[int, ...]
                ) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """``flat`` holds elements ``[lo, lo + numel)`` of a rank-local tensor of ``local_shape`` that starts at
    ``tp_offset`` in the global one (``Placement.offset``): its boxes as (global offsets, view of ``flat``
    shaped like the box)."""
    out = []
    for offsets, sizes, start in flat_boxes(tuple(local_shape), lo, lo + flat.numel()):
        n = 1
        for s in sizes:
            n *= s
        view = flat[start - lo:start - lo + n].view(sizes)
        out.append((tuple(o + t for o, t in zip(offsets, tp_offset, strict=True)), view))
    return out


def add_boxes(entries: dict, key: str, shape: torch.Size, boxes: list) -> None:
    """Append ``boxes`` to ``entries[key]`` (a :class:`Boxes` of global ``shape``)."""
    entries.setdefault(key, Boxes(shape)).chunks.extend(boxes)


def _split(state_dict: dict) -> tuple[dict, dict[str, Boxes]]:
    plain = {k: v for k, v in state_dict.items() if not isinstance(v, Boxes)}
    return plain, {k: v for k, v in state_dict.items() if isinstance(v, Boxes)}


class BoxSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, plus one write item per box of every :class:`Boxes` value."""

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        plain, self.boxes = _split(state_dict)
        super().set_up_planner(plain, storage_meta, is_coordinator)

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        for fqn, boxes in self.boxes.items():
            for offsets, tensor in boxes.chunks:
                where = torch.Size(offsets)
                items.append(WriteItem(
                    index=MetadataIndex(fqn, where), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=where, sizes=tensor.size()),
                                                properties=TensorProperties.create_from_tensor(tensor),
                                                size=boxes.shape)))
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        if index.fqn in self.boxes:
            return self.boxes[index.fqn].at(index)
        return super().lookup_object(index)


class BoxLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, plus reads into the boxes of every :class:`Boxes` value."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        plain, self.boxes = _split(state_dict)
        super().set_up_planner(plain, metadata, is_coordinator)

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        for fqn, boxes in self.boxes.items():
            md = self.metadata.state_dict_metadata[fqn]
            if tuple(md.size) != tuple(boxes.shape):
                raise ValueError(f"Size mismatch between saved {md.size} and current: {boxes.shape} for {fqn}")
            chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.size()) for o, t in boxes.chunks]
            items += create_read_items_for_chunk_list(fqn, md, chunks)
        return dataclasses.replace(plan, items=[*plan.items, *items])

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.boxes:
            return self.boxes[index.fqn].at(index)
        return super().lookup_tensor(index)
