"""Per-tensor recipes: how one of ptdp's full parameters is built from Hugging Face tensors.

A family's adapter declares, for every ptdp parameter name, a :data:`Recipe` over HF tensor names: take a
tensor (or a range of its rows), concatenate along a dimension, stack, pad with zeros, swap two dimensions,
view one dimension as two (blocks or interleaved), drop a dimension of size 1, dequantize MXFP4 blocks, take
the first of several layouts the checkpoint holds, write a tensor's copies on export. The recipe is data,
not code over full tensors, so the same declaration serves three readers:

- ``ptdp import`` evaluates it over the whole tensor (``ptdp.models.hf_tensors.materialize``);
- ``ptdp train --load HF_DIR`` evaluates it over one rank's box only (``recipe.read``): every ``Take``
  asks its file for just the rows and columns the box covers (``safe_open(...).get_slice(name)[...]``);
- ``ptdp export`` runs it backwards (``recipe.scatter``): one full ptdp tensor in, its HF pieces out.

The three cannot drift apart: there is one mapping per family. Each kind of step is one record with the
same five methods (the tensors it ``takes``, the ``built_shape`` it builds from the HF shapes, ``read`` of a
box, ``scatter`` back, its ``extent`` along a dimension when the recipe alone fixes it): a new kind is one
more record, not a branch in five functions. Nothing here imports torch at module level (the launcher
checks an HF directory against the recipes before any worker starts).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ptdp.config import ConfigError

if TYPE_CHECKING:
    import torch


class RecipeError(ConfigError):
    """An HF checkpoint that lacks what a recipe takes, or holds it in another shape; one line."""


Shapes = Mapping[str, tuple[int, ...]]
Box = tuple[tuple[int, int], ...]  # per dimension (start, stop)
# fetch(name, box) -> those elements of the HF tensor, in its own dtype
Fetch = Callable[[str, Box], "torch.Tensor"]
Piece = tuple[str, "tuple[int, int] | None", "torch.Tensor"]  # (HF name, its rows or None, values)


def _names(recipe: Recipe) -> list[str]:
    return [t.name for t in recipe.takes()]


def _split(recipe: Unflatten | Interleaved, shapes: Shapes, need: str) -> tuple[int, ...]:
    """The part's shape with dimension ``dim`` as two, ``[n, size / n]``; RecipeError saying ``need`` if it
    cannot be."""
    inner, dim, n = recipe.part.built_shape(shapes), recipe.dim, recipe.n
    if len(inner) <= dim or inner[dim] % n:
        raise RecipeError(f"{_names(recipe)} has shape {inner}; {need}")
    return (*inner[:dim], n, inner[dim] // n, *inner[dim + 1:])


class _Parts:
    """A step over several parts: it takes what they take."""

    def takes(self) -> list[Take]:
        return [t for part in self.parts for t in part.takes()]


class _OnePart:
    """A step over one part: it takes what the part takes."""

    def takes(self) -> list[Take]:
        return self.part.takes()


@dataclass(frozen=True)
class Take:
    """HF tensor ``name`` (rows ``[lo, hi)`` of it when ``rows`` is given), cast to fp32."""

    name: str
    rows: tuple[int, int] | None = None

    def takes(self) -> list[Take]:
        return [self]

    def built_shape(self, shapes: Shapes) -> tuple[int, ...]:
        if self.name not in shapes:
            raise RecipeError(f"the checkpoint has no tensor {self.name}")
        shape = tuple(shapes[self.name])
        if self.rows is None:
            return shape
        lo, hi = self.rows
        if not shape or hi > shape[0]:
            raise RecipeError(f"{self.name} has shape {shape}; rows {lo}:{hi} are needed")
        return (hi - lo, *shape[1:])

    def read(self, box: Box, shapes: Shapes, fetch: Fetch) -> torch.Tensor:
        import torch

        if self.rows is not None:
            lo = self.rows[0]
            box = ((box[0][0] + lo, box[0][1] + lo), *box[1:])
        return fetch(self.name, box).to(torch.float32)

    def scatter(self, tensor: torch.Tensor) -> list[Piece]:
        return [(self.name, self.rows, tensor)]

    def extent(self, dim: int) -> int | None:
        return self.rows[1] - self.rows[0] if self.rows is not None and dim == 0 else None


@dataclass(frozen=True)
class Cat(_Parts):
    """The parts concatenated along ``dim``."""

    parts: tuple[Recipe, ...]
    dim: int = 0

    def built_shape(self, shapes: Shapes) -> tuple[int, ...]:
        parts = [p.built_shape(shapes) for p in self.parts]
        if len({p[:self.dim] + p[self.dim + 1:] for p in parts}) != 1:
            raise RecipeError(f"cannot concatenate {_names(self)}: shapes {parts}")
        first = parts[0]
        return (*first[:self.dim], sum(p[self.dim] for p in parts), *first[self.dim + 1:])

    def read(self, box: Box, shapes: Shapes, fetch: Fetch) -> torch.Tensor:
        import torch

        dim, pieces, offset = self.dim, [], 0
        a, b = box[dim]
        for part in self.parts:
            size = part.built_shape(shapes)[dim]
            lo, hi = max(a, offset), min(b, offset + size)
            if lo < hi:
                pieces.append(part.read((*box[:dim], (lo - offset, hi - offset), *box[dim + 1:]), shapes, fetch))
            offset += size
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)

    def scatter(self, tensor: torch.Tensor) -> list[Piece]:
        known = [p.extent(self.dim) for p in self.parts]
        if known.count(None) > 1:
            raise RecipeError(f"cannot split {_names(self)}: more than one part of unknown size")
        free = tensor.shape[self.dim] - sum(k for k in known if k is not None)
        sizes = [free if k is None else k for k in known]
        return [piece for part, t in zip(self.parts, tensor.split(sizes, dim=self.dim), strict=True)
                for piece in part.scatter(t)]

    def extent(self, dim: int) -> int | None:
        sizes = [p.extent(dim) for p in self.parts]
        if self.dim == dim:
            return None if None in sizes else sum(sizes)
        return next((s for s in sizes if s is not None), None)


@dataclass(frozen=True)
class Stack(_Parts):
    """The parts stacked along a new leading dimension (ptdp's ``[3, a·d, h]`` qkv, ``[2, ffn, h]`` fc1)."""

    parts: tuple[Recipe, ...]

    def built_shape(self, shapes: Shapes) -> tuple[int, ...]:
        parts = [p.built_shape(shapes) for p in self.parts]
        if len(set(parts)) != 1:
            raise RecipeError(f"cannot stack {_names(self)}: shapes {parts} differ")
        return (len(parts), *parts[0])

    def read(self, box: Box, shapes: Shapes, fetch: Fetch) -> torch.Tensor:
        import torch

        (a, b), inner = box[0], box[1:]
        return torch.stack([self.parts[i].read(inner, shapes, fetch) for i in range(a, b)])

    def scatter(self, tensor: torch.Tensor) -> list[Piece]:
        return [piece for part, t in zip(self.parts, tensor.unbind(0), strict=True) for piece in part.scatter(t)]

    def extent(self, dim: int) -> int | None:
        return len(self.parts) if dim == 0 else self.parts[0].extent(dim - 1)


@dataclass(frozen=True)
class Zeros:
    """A block of zeros (the rows ptdp pads a vocabulary with); export drops it."""

    shape: tuple[int, ...]

    def takes(self) -> list[Take]:
        return []

    def built_shape(self, shapes: Shapes) -> tuple[int, ...]:
        return tuple(self.shape)

    def read(self, box: Box, shapes: Shapes, fetch: Fetch) -> torch.Tensor:
        import torch

        return torch.zeros([b - a for a, b in box], dtype=torch.float32)

    def scatter(self, tensor: torch.Tensor) -> list[Piece]:
        return []

    def extent(self, dim: int) -> int | None:
        return self.shape[dim]


@dataclass(frozen=True)
class Transpose(_OnePart):
    """The part with dimensions ``dims`` swapped: by default a 2-D part transposed (GPT-2's ``Conv1D``
    weights are ``[in, out]``; ptdp's linears ``[out, in]``), ``(1, 2)`` each expert's matrix of an
    ``[E, in, out]`` stack (GPT-OSS)."""

    part: Recipe
    dims: tuple[int, int] = (0, 1)

    def built_shape(self, shapes: Shapes) -> tuple[int, ...]:
        inner, (i, j) = list(self.part.built_shape(shapes)), self.dims
        rank = 2 if self.dims == (0, 1) else max(i, j) + 1
        if len(inner) != rank:
            raise RecipeError(f"{_names(self)} has shape {tuple(inner)}; a {rank}-D tensor is needed")
        inner[i], inner[j] = inner[j], inner[i]
        return tuple(inner)

    def read(self, box: Box, shapes: Shapes, fetch: Fetch) -> torch.Tensor:
        (i, j), inner = self.dims, list(box)
        inner[i], inner[j] = inner[j], inner[i]
        return self.part.read(tuple(inner), shapes, fetch).transpose(i, j)

    def scatter(self, tensor: torch.Tensor) -> list[Piece]:
        return self.part.scatter(tensor.transpose(*self.dims))

    def extent(self, dim: int) -> int | None:
        i, j = self.dims
        return self.part.extent(j if dim == i else i if dim == j else dim)


@dataclass(frozen=True)
class Unflatten(_OnePart):
    """The part's dimension ``dim`` (size ``n·m``) viewed as ``[n, m]`` blocks (GPT-2's ``[3h]`` q|k|v as
    ptdp's ``[3, h]``; transformers 5's fused experts ``gate_up_proj [E, 2f, h]``, gate rows first, as ptdp's
    ``[E, 2, f, h]`` with ``dim`` 1). A box reads, per block it covers, only its rows of that block."""

    part: Recipe
    n: int
    dim: int = 0

    def built_shape(self, shapes: Shapes) -> tuple[int, ...]:
        return _split(self, shapes, f"{self.n} equal blocks along dimension {self.dim} are needed")

    def read(self, box: Box, shapes: Shapes, fetch: Fetch) -> torch.Tensor:
        """Block i's rows ``[c, d)`` are the part's rows ``[i·m + c, i·m + d)``."""
        import torch

        dim = self.dim
        m = self.part.built_shape(shapes)[dim] // self.n
        (a, b), (c, d), lead, rest = box[dim], box[dim + 1], box[:dim], box[dim + 2:]
        return torch.stack([self.part.read((*lead, (i * m + c, i * m + d), *rest), shapes, fetch)
                            for i in range(a, b)], dim=dim)

    def scatter(self, tensor: torch.Tensor) -> list[Piece]:
        return self.part.scatter(tensor.flatten(self.dim, self.dim + 1))

    def extent(self, dim: int) -> int | None:
        if dim == self.dim:
            return self.n
        inner = self.part.extent(dim if dim < self.dim else dim - 1)
        return inner // self.n if dim == self.dim + 1 and inner is not None else inner


@dataclass(frozen=True)
class Squeeze(_OnePart):
    """The part without its dimension ``dim``, of size 1 (Qwen3-Next's depthwise ``conv1d.weight [C, 1, k]``
    as ptdp's ``[C, k]``)."""

    part: Recipe
    dim: int

    def built_shape(self, shapes: Shapes) -> tuple[int, ...]:
        inner, dim = self.part.built_shape(shapes), self.dim
        if len(inner) <= dim or inner[dim] != 1:
            raise RecipeError(f"{_names(self)} has shape {inner}; dimension {dim} must be 1")
        return (*inner[:dim], *inner[dim + 1:])

    def read(self, box: Box, shapes: Shapes, fetch: Fetch) -> torch.Tensor:
        return self.part.read((*box[:self.dim], (0, 1), *box[self.dim:]), shapes, fetch).squeeze(self.dim)

    def scatter(self, tensor: torch.Tensor) -> list[Piece]:
        return self.part.scatter(tensor.unsqueeze(self.dim))

    def extent(self, dim: int) -> int | None:
        return self.part.extent(dim if dim < self.dim else dim + 1)


@dataclass(frozen=True)
class Interleaved(_OnePart):
    """The part's dimension ``dim`` (size ``m·n``), its element ``j·n + k`` at ``[k, j]``: viewed as two
    dimensions ``[n, m]`` (GPT-OSS's ``gate_up_proj`` alternates gate and up: ptdp's ``[2, f]``). A box reads
    the part's elements ``[a·n, b·n)`` for its ``j`` range ``[a, b)``, never the whole dimension."""

    part: Recipe
    n: int
    dim: int = 0

    def built_shape(self, shapes: Shapes) -> tuple[int, ...]:
        return _split(self, shapes, f"dimension {self.dim} must hold {self.n} interleaved parts")

    def read(self, box: Box, shapes: Shapes, fetch: Fetch) -> torch.Tensor:
        n, dim = self.n, self.dim
        (k0, k1), (a, b) = box[dim], box[dim + 1]
        value = self.part.read((*box[:dim], (a * n, b * n), *box[dim + 2:]), shapes, fetch)
        return value.unflatten(dim, (b - a, n)).narrow(dim + 1, k0, k1 - k0).transpose(dim, dim + 1)

    def scatter(self, tensor: torch.Tensor) -> list[Piece]:
        return self.part.scatter(tensor.transpose(self.dim, self.dim + 1).flatten(self.dim, self.dim + 1))

    def extent(self, dim: int) -> int | None:
        if dim == self.dim:
            return self.n
        inner = self.part.extent(dim if dim < self.dim else self.dim if dim == self.dim + 1 else dim - 1)
        return inner // self.n if dim == self.dim + 1 and inner is not None else inner


@dataclass(frozen=True)
class MXFP4:
    """An MXFP4 tensor dequantized to fp32: ``blocks [..., rows, G, 16]`` (two 4-bit values a byte) and
    ``scales [..., rows, G]`` (a power of two per 32 values) are ``[..., rows, G·32]``. A box reads and
    decodes only its rows and the 32-value blocks its columns touch (``ptdp.models.mxfp4``). Export never
    writes it: it sits behind an unquantized layout in a :class:`OneOf`."""

    blocks: str
    scales: str

    def takes(self) -> list[Take]:
        return [Take(self.blocks), Take(self.scales)]

    def built_shape(self, shapes: Shapes) -> tuple[int, ...]:
        blocks, scales = Take(self.blocks).built_shape(shapes), Take(self.scales).built_shape(shapes)
        if len(blocks) < 3 or blocks[:-1] != scales or blocks[-1] != 16:
            raise RecipeError(f"MXFP4 {self.blocks} {blocks} and {self.scales} {scales} do not pair (one scale per "
                              "block of 16 bytes)")
        return (*blocks[:-2], blocks[-2] * 32)

    def read(self, box: Box, shapes: Shapes, fetch: Fetch) -> torch.Tensor:
        from ptdp.models.mxfp4 import dequantize_rows

        (c0, c1), lead = box[-1], box[:-1]
        g0, g1 = c0 // 32, -(-c1 // 32)
        blocks = fetch(self.blocks, (*lead, (g0, g1), (0, 16)))
        values = dequantize_rows(blocks, fetch(self.scales, (*lead, (g0, g1))))
        return values.narrow(-1, c0 - 32 * g0, c1 - c0)

    def scatter(self, tensor: torch.Tensor) -> list[Piece]:
        raise RecipeError(f"{self.blocks}: export writes unquantized tensors, not MXFP4 blocks")

    def extent(self, dim: int) -> int | None:
        return None


@dataclass(frozen=True)
class OneOf:
    """The first of ``parts`` whose tensors the checkpoint holds (GPT-OSS's experts: unquantized, else their
    MXFP4 blocks and scales); export writes the first."""

    parts: tuple[Recipe, ...]

    def chosen(self, shapes: Shapes) -> Recipe:
        """The first part whose tensors are all in ``shapes`` (else the first, to name what lacks)."""
        return next((p for p in self.parts if all(t.name in shapes for t in p.takes())), self.parts[0])

    def takes(self) -> list[Take]:
        return self.parts[0].takes()

    def built_shape(self, shapes: Shapes) -> tuple[int, ...]:
        return self.chosen(shapes).built_shape(shapes)

    def read(self, box: Box, shapes: Shapes, fetch: Fetch) -> torch.Tensor:
        return self.chosen(shapes).read(box, shapes, fetch)

    def scatter(self, tensor: torch.Tensor) -> list[Piece]:
        return self.parts[0].scatter(tensor)

    def extent(self, dim: int) -> int | None:
        return self.parts[0].extent(dim)


@dataclass(frozen=True)
class Copies(_OnePart):
    """``part``, which the checkpoint also holds whole under the names ``copies`` (DeepSeek-V3's MTP modules
    repeat the embedding and the output layer): read from ``part`` alone; export writes every copy."""

    part: Recipe
    copies: tuple[str, ...]

    def built_shape(self, shapes: Shapes) -> tuple[int, ...]:
        return self.part.built_shape(shapes)

    def read(self, box: Box, shapes: Shapes, fetch: Fetch) -> torch.Tensor:
        return self.part.read(box, shapes, fetch)

    def scatter(self, tensor: torch.Tensor) -> list[Piece]:
        return [*self.part.scatter(tensor), *((name, None, tensor) for name in self.copies)]

    def extent(self, dim: int) -> int | None:
        return self.part.extent(dim)


Recipe = Take | Cat | Stack | Zeros | Transpose | Unflatten | Squeeze | Interleaved | MXFP4 | OneOf | Copies
