"""Per-tensor recipes: how one of ptdp's full parameters is built from Hugging Face tensors.

A family's adapter declares, for every ptdp parameter name, a :data:`Recipe` over HF tensor names: take a
tensor (or a range of its rows), concatenate along a dimension, stack, pad with zeros, swap two dimensions,
view one dimension as two (blocks or interleaved), drop a dimension of size 1, dequantize MXFP4 blocks, take
the first of several layouts the checkpoint holds, write a tensor's copies on export. The recipe is data,
not code over full tensors, so the same declaration serves three readers:

- ``ptdp import`` evaluates it over the whole tensor (:func:`materialize`);
- ``ptdp train --load HF_DIR`` evaluates it over one rank's box only (:func:`read_box`): every ``Take``
  asks its file for just the rows and columns the box covers (``safe_open(...).get_slice(name)[...]``);
- ``ptdp export`` runs it backwards (:func:`scatter`): one full ptdp tensor in, its HF pieces out.

The three cannot drift apart: there is one mapping per family. Nothing here imports torch at module level
(the launcher checks an HF directory against the recipes before any worker starts).
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


@dataclass(frozen=True)
class Take:
    """HF tensor ``name`` (rows ``[lo, hi)`` of it when ``rows`` is given), cast to fp32."""

    name: str
    rows: tuple[int, int] | None = None


@dataclass(frozen=True)
class Cat:
    """The parts concatenated along ``dim``."""

    parts: tuple[Recipe, ...]
    dim: int = 0


@dataclass(frozen=True)
class Stack:
    """The parts stacked along a new leading dimension (ptdp's ``[3, a·d, h]`` qkv, ``[2, ffn, h]`` fc1)."""

    parts: tuple[Recipe, ...]


@dataclass(frozen=True)
class Zeros:
    """A block of zeros (the rows ptdp pads a vocabulary with)."""

    shape: tuple[int, ...]


@dataclass(frozen=True)
class Transpose:
    """The part with dimensions ``dims`` swapped: by default a 2-D part transposed (GPT-2's ``Conv1D``
    weights are ``[in, out]``; ptdp's linears ``[out, in]``), ``(1, 2)`` each expert's matrix of an
    ``[E, in, out]`` stack (GPT-OSS)."""

    part: Recipe
    dims: tuple[int, int] = (0, 1)


@dataclass(frozen=True)
class Unflatten:
    """The part's dimension ``dim`` (size ``n·m``) viewed as ``[n, m]`` blocks (GPT-2's ``[3h]`` q|k|v as
    ptdp's ``[3, h]``; transformers 5's fused experts ``gate_up_proj [E, 2f, h]``, gate rows first, as ptdp's
    ``[E, 2, f, h]`` with ``dim`` 1). A box reads, per block it covers, only its rows of that block."""

    part: Recipe
    n: int
    dim: int = 0


@dataclass(frozen=True)
class Squeeze:
    """The part without its dimension ``dim``, of size 1 (Qwen3-Next's depthwise ``conv1d.weight [C, 1, k]``
    as ptdp's ``[C, k]``)."""

    part: Recipe
    dim: int


@dataclass(frozen=True)
class Interleaved:
    """The part's dimension ``dim`` (size ``m·n``), its element ``j·n + k`` at ``[k, j]``: viewed as two
    dimensions ``[n, m]`` (GPT-OSS's ``gate_up_proj`` alternates gate and up: ptdp's ``[2, f]``). A box reads
    the part's elements ``[a·n, b·n)`` for its ``j`` range ``[a, b)``, never the whole dimension."""

    part: Recipe
    n: int
    dim: int = 0


@dataclass(frozen=True)
class MXFP4:
    """An MXFP4 tensor dequantized to fp32: ``blocks [..., rows, G, 16]`` (two 4-bit values a byte) and
    ``scales [..., rows, G]`` (a power of two per 32 values) are ``[..., rows, G·32]``. A box reads and
    decodes only its rows and the 32-value blocks its columns touch (``ptdp.models.mxfp4``). Export never
    writes it: it sits behind an unquantized layout in a :class:`OneOf`."""

    blocks: str
    scales: str


@dataclass(frozen=True)
class OneOf:
    """The first of ``parts`` whose tensors the checkpoint holds (GPT-OSS's experts: unquantized, else their
    MXFP4 blocks and scales); export writes the first."""

    parts: tuple[Recipe, ...]


@dataclass(frozen=True)
class Copies:
    """``part``, which the checkpoint also holds whole under the names ``copies`` (DeepSeek-V3's MTP modules
    repeat the embedding and the output layer): read from ``part`` alone; export writes every copy."""

    part: Recipe
    copies: tuple[str, ...]


Recipe = Take | Cat | Stack | Zeros | Transpose | Unflatten | Squeeze | Interleaved | MXFP4 | OneOf | Copies
Shapes = Mapping[str, tuple[int, ...]]
# fetch(name, per-dimension (start, stop)) -> those elements of the HF tensor, in its own dtype
Fetch = Callable[[str, tuple[tuple[int, int], ...]], "torch.Tensor"]


def takes(recipe: Recipe) -> list[Take]:
    """Every ``Take`` of ``recipe``, in order."""
    if isinstance(recipe, Take):
        return [recipe]
    if isinstance(recipe, (Cat, Stack)):
        return [t for part in recipe.parts for t in takes(part)]
    if isinstance(recipe, (Transpose, Unflatten, Squeeze, Interleaved, Copies)):
        return takes(recipe.part)
    if isinstance(recipe, MXFP4):
        return [Take(recipe.blocks), Take(recipe.scales)]
    if isinstance(recipe, OneOf):
        return takes(recipe.parts[0])
    return []


def _chosen(recipe: OneOf, shapes: Shapes) -> Recipe:
    """The first part of ``recipe`` whose tensors are all in ``shapes`` (else the first, to name what lacks)."""
    return next((p for p in recipe.parts if all(t.name in shapes for t in takes(p))),
                recipe.parts[0])


def shape_of(recipe: Recipe, shapes: Shapes) -> tuple[int, ...]:
    """The shape ``recipe`` builds, given the HF tensors' shapes; :class:`RecipeError` when a tensor is
    missing or the parts do not fit together."""
    if isinstance(recipe, Zeros):
        return tuple(recipe.shape)
    if isinstance(recipe, Take):
        if recipe.name not in shapes:
            raise RecipeError(f"the checkpoint has no tensor {recipe.name}")
        shape = tuple(shapes[recipe.name])
        if recipe.rows is None:
            return shape
        lo, hi = recipe.rows
        if not shape or hi > shape[0]:
            raise RecipeError(f"{recipe.name} has shape {shape}; rows {lo}:{hi} are needed")
        return (hi - lo, *shape[1:])
    if isinstance(recipe, Transpose):
        inner, (i, j) = list(shape_of(recipe.part, shapes)), recipe.dims
        if len(inner) != (2 if recipe.dims == (0, 1) else max(i, j) + 1):
            raise RecipeError(f"{[t.name for t in takes(recipe)]} has shape {tuple(inner)}; "
                              f"a {2 if recipe.dims == (0, 1) else max(i, j) + 1}-D tensor is needed")
        inner[i], inner[j] = inner[j], inner[i]
        return tuple(inner)
    if isinstance(recipe, Interleaved):
        inner, dim = shape_of(recipe.part, shapes), recipe.dim
        if len(inner) <= dim or inner[dim] % recipe.n:
            raise RecipeError(f"{[t.name for t in takes(recipe)]} has shape {inner}; dimension {dim} must hold "
                              f"{recipe.n} interleaved parts")
        return (*inner[:dim], recipe.n, inner[dim] // recipe.n, *inner[dim + 1:])
    if isinstance(recipe, MXFP4):
        for name in (recipe.blocks, recipe.scales):
            if name not in shapes:
                raise RecipeError(f"the checkpoint has no tensor {name}")
        blocks, scales = tuple(shapes[recipe.blocks]), tuple(shapes[recipe.scales])
        if len(blocks) < 3 or blocks[:-1] != scales or blocks[-1] != 16:
            raise RecipeError(f"MXFP4 {recipe.blocks} {blocks} and {recipe.scales} {scales} do not pair (one "
                              "scale per block of 16 bytes)")
        return (*blocks[:-2], blocks[-2] * 32)
    if isinstance(recipe, OneOf):
        return shape_of(_chosen(recipe, shapes), shapes)
    if isinstance(recipe, Copies):
        return shape_of(recipe.part, shapes)
    if isinstance(recipe, Unflatten):
        inner, dim = shape_of(recipe.part, shapes), recipe.dim
        if len(inner) <= dim or inner[dim] % recipe.n:
            raise RecipeError(f"{[t.name for t in takes(recipe)]} has shape {inner}; {recipe.n} equal blocks "
                              f"along dimension {dim} are needed")
        return (*inner[:dim], recipe.n, inner[dim] // recipe.n, *inner[dim + 1:])
    if isinstance(recipe, Squeeze):
        inner, dim = shape_of(recipe.part, shapes), recipe.dim
        if len(inner) <= dim or inner[dim] != 1:
            raise RecipeError(f"{[t.name for t in takes(recipe)]} has shape {inner}; dimension {dim} must be 1")
        return (*inner[:dim], *inner[dim + 1:])
    parts = [shape_of(p, shapes) for p in recipe.parts]
    if isinstance(recipe, Stack):
        if len(set(parts)) != 1:
            raise RecipeError(f"cannot stack {[t.name for t in takes(recipe)]}: shapes {parts} differ")
        return (len(parts), *parts[0])
    rest = {p[:recipe.dim] + p[recipe.dim + 1:] for p in parts}
    if len(rest) != 1:
        raise RecipeError(f"cannot concatenate {[t.name for t in takes(recipe)]}: shapes {parts}")
    first = parts[0]
    return (*first[:recipe.dim], sum(p[recipe.dim] for p in parts), *first[recipe.dim + 1:])


def read_box(recipe: Recipe, box: tuple[tuple[int, int], ...], shapes: Shapes, fetch: Fetch) -> torch.Tensor:
    """Elements ``box`` (per dimension ``(start, stop)``) of the tensor ``recipe`` builds, in fp32, reading
    from each HF tensor only the part of it that lands in the box."""
    import torch

    if isinstance(recipe, Zeros):
        return torch.zeros([b - a for a, b in box], dtype=torch.float32)
    if isinstance(recipe, Take):
        if recipe.rows is not None:
            lo = recipe.rows[0]
            box = ((box[0][0] + lo, box[0][1] + lo), *box[1:])
        return fetch(recipe.name, box).to(torch.float32)
    if isinstance(recipe, Transpose):
        (i, j), inner = recipe.dims, list(box)
        inner[i], inner[j] = inner[j], inner[i]
        return read_box(recipe.part, tuple(inner), shapes, fetch).transpose(i, j)
    if isinstance(recipe, Interleaved):  # [k, j] is the part's j·n + k: read rows [a·n, b·n), keep k's
        n, dim = recipe.n, recipe.dim
        (k0, k1), (a, b) = box[dim], box[dim + 1]
        value = read_box(recipe.part, (*box[:dim], (a * n, b * n), *box[dim + 2:]), shapes, fetch)
        value = value.unflatten(dim, (b - a, n)).narrow(dim + 1, k0, k1 - k0)
        return value.transpose(dim, dim + 1)
    if isinstance(recipe, MXFP4):  # the box's rows, and its columns' 32-value blocks
        from ptdp.models.mxfp4 import dequantize_rows

        (c0, c1), lead = box[-1], box[:-1]
        g0, g1 = c0 // 32, -(-c1 // 32)
        blocks = fetch(recipe.blocks, (*lead, (g0, g1), (0, 16)))
        values = dequantize_rows(blocks, fetch(recipe.scales, (*lead, (g0, g1))))
        return values.narrow(-1, c0 - 32 * g0, c1 - c0)
    if isinstance(recipe, OneOf):
        return read_box(_chosen(recipe, shapes), box, shapes, fetch)
    if isinstance(recipe, Copies):
        return read_box(recipe.part, box, shapes, fetch)
    if isinstance(recipe, Unflatten):  # block i's rows [c, d) are the part's rows [i·m + c, i·m + d)
        dim = recipe.dim
        m = shape_of(recipe.part, shapes)[dim] // recipe.n
        (a, b), (c, d), lead, rest = box[dim], box[dim + 1], box[:dim], box[dim + 2:]
        return torch.stack([read_box(recipe.part, (*lead, (i * m + c, i * m + d), *rest), shapes, fetch)
                            for i in range(a, b)], dim=dim)
    if isinstance(recipe, Squeeze):
        inner = (*box[:recipe.dim], (0, 1), *box[recipe.dim:])
        return read_box(recipe.part, inner, shapes, fetch).squeeze(recipe.dim)
    if isinstance(recipe, Stack):
        (a, b), inner = box[0], box[1:]
        return torch.stack([read_box(recipe.parts[i], inner, shapes, fetch) for i in range(a, b)])
    dim, pieces, offset = recipe.dim, [], 0
    a, b = box[dim]
    for part in recipe.parts:
        size = shape_of(part, shapes)[dim]
        lo, hi = max(a, offset), min(b, offset + size)
        if lo < hi:
            sub = (*box[:dim], (lo - offset, hi - offset), *box[dim + 1:])
            pieces.append(read_box(part, sub, shapes, fetch))
        offset += size
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def materialize(recipes: Mapping[str, Recipe], hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every ptdp full tensor the recipes build from ``hf`` (HF's tensors, all in memory: ``ptdp import``)."""
    shapes = {name: tuple(t.shape) for name, t in hf.items()}

    def fetch(name: str, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        return hf[name][tuple(slice(a, b) for a, b in box)]

    out = {}
    for name, recipe in recipes.items():
        full = tuple((0, n) for n in shape_of(recipe, shapes))
        out[name] = read_box(recipe, full, shapes, fetch).contiguous()
    return out


def scatter(recipe: Recipe, tensor: torch.Tensor) -> list[tuple[str, tuple[int, int] | None, torch.Tensor]]:
    """The inverse of a recipe: ``(HF name, its rows or None, values)`` for every ``Take`` in ``recipe``,
    cut from ``tensor`` (the full ptdp tensor); zeros blocks (vocabulary padding) are dropped."""
    if isinstance(recipe, Take):
        return [(recipe.name, recipe.rows, tensor)]
    if isinstance(recipe, Zeros):
        return []
    if isinstance(recipe, Transpose):
        return scatter(recipe.part, tensor.transpose(*recipe.dims))
    if isinstance(recipe, Interleaved):
        return scatter(recipe.part, tensor.transpose(recipe.dim, recipe.dim + 1).flatten(recipe.dim, recipe.dim + 1))
    if isinstance(recipe, MXFP4):
        raise RecipeError(f"{recipe.blocks}: export writes unquantized tensors, not MXFP4 blocks")
    if isinstance(recipe, OneOf):
        return scatter(recipe.parts[0], tensor)
    if isinstance(recipe, Copies):
        return [*scatter(recipe.part, tensor), *((name, None, tensor) for name in recipe.copies)]
    if isinstance(recipe, Unflatten):
        return scatter(recipe.part, tensor.flatten(recipe.dim, recipe.dim + 1))
    if isinstance(recipe, Squeeze):
        return scatter(recipe.part, tensor.unsqueeze(recipe.dim))
    if isinstance(recipe, Stack):
        return [piece for part, t in zip(recipe.parts, tensor.unbind(0), strict=True) for piece in scatter(part, t)]
    known = [_extent(p, recipe.dim) for p in recipe.parts]
    if known.count(None) > 1:
        raise RecipeError(f"cannot split {[t.name for t in takes(recipe)]}: more than one part of unknown size")
    free = tensor.shape[recipe.dim] - sum(k for k in known if k is not None)
    sizes = [free if k is None else k for k in known]
    out = []
    for part, piece in zip(recipe.parts, tensor.split(sizes, dim=recipe.dim), strict=True):
        out += scatter(part, piece)
    return out


def _extent(recipe: Recipe, dim: int) -> int | None:
    """The size of ``recipe`` along ``dim`` when it follows from the recipe alone, else None."""
    if isinstance(recipe, Zeros):
        return recipe.shape[dim]
    if isinstance(recipe, Take):
        return recipe.rows[1] - recipe.rows[0] if recipe.rows is not None and dim == 0 else None
    if isinstance(recipe, Stack):
        return len(recipe.parts) if dim == 0 else _extent(recipe.parts[0], dim - 1)
    if isinstance(recipe, Transpose):
        i, j = recipe.dims
        return _extent(recipe.part, j if dim == i else i if dim == j else dim)
    if isinstance(recipe, Interleaved):
        if dim == recipe.dim:
            return recipe.n
        inner = _extent(recipe.part, dim if dim < recipe.dim else recipe.dim if dim == recipe.dim + 1 else dim - 1)
        return inner // recipe.n if dim == recipe.dim + 1 and inner is not None else inner
    if isinstance(recipe, MXFP4):
        return None
    if isinstance(recipe, OneOf):
        return _extent(recipe.parts[0], dim)
    if isinstance(recipe, Copies):
        return _extent(recipe.part, dim)
    if isinstance(recipe, Unflatten):
        if dim == recipe.dim:
            return recipe.n
        inner = _extent(recipe.part, dim if dim < recipe.dim else dim - 1)
        return inner // recipe.n if dim == recipe.dim + 1 and inner is not None else inner
    if isinstance(recipe, Squeeze):
        return _extent(recipe.part, dim if dim < recipe.dim else dim + 1)
    sizes = [_extent(p, dim) for p in recipe.parts]
    if recipe.dim == dim:
        return None if None in sizes else sum(sizes)
    return next((s for s in sizes if s is not None), None)


def assemble(pieces: list[tuple[tuple[int, int] | None, torch.Tensor]], name: str) -> torch.Tensor:
    """One HF tensor from the row ranges :func:`scatter` cut for it (a GQA ``q_proj``: one range per group)."""
    import torch

    if len(pieces) == 1 and pieces[0][0] is None:
        return pieces[0][1]
    ordered = sorted(pieces, key=lambda p: p[0][0])
    end = 0
    for rows, _ in ordered:
        if rows is None or rows[0] != end:
            raise RecipeError(f"{name}: the recipes do not cover its rows exactly once")
        end = rows[1]
    return torch.cat([t for _, t in ordered])


def unmaterialize(recipes: Mapping[str, Recipe], tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`materialize`: every HF tensor the recipes cut from ptdp's full ``tensors`` (the
    whole-model export; ``ptdp.hf.streamed`` does the same one parameter at a time)."""
    pieces: dict[str, list] = {}
    for name, recipe in recipes.items():
        for hf_name, rows, value in scatter(recipe, tensors[name]):
            pieces.setdefault(hf_name, []).append((rows, value))
    return {hf_name: assemble(parts, hf_name) for hf_name, parts in pieces.items()}
