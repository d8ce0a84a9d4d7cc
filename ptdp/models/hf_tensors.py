"""The recipes (:mod:`ptdp.models.hf_recipe`) applied to a whole model's tensors held in memory:
``materialize`` builds ptdp's full tensors from HF's (``ptdp import``), ``unmaterialize`` cuts HF's from
ptdp's (the whole-model export), ``assemble`` joins the row ranges of one HF tensor that several ptdp
parameters fill (also for the streamed export, ``ptdp.hf.streamed``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ptdp.models.hf_recipe import Recipe, RecipeError

if TYPE_CHECKING:
    import torch


def materialize(recipes: Mapping[str, Recipe], hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every ptdp full tensor the recipes build from ``hf`` (HF's tensors, all in memory: ``ptdp import``)."""
    shapes = {name: tuple(t.shape) for name, t in hf.items()}

    def fetch(name: str, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        return hf[name][tuple(slice(a, b) for a, b in box)]

    out = {}
    for name, recipe in recipes.items():
        full = tuple((0, n) for n in recipe.built_shape(shapes))
        out[name] = recipe.read(full, shapes, fetch).contiguous()
    return out


def assemble(pieces: list[tuple[tuple[int, int] | None, torch.Tensor]], name: str) -> torch.Tensor:
    """One HF tensor from the row ranges ``Recipe.scatter`` cut for it (a GQA ``q_proj``: one range per group)."""
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
        for hf_name, rows, value in recipe.scatter(tensors[name]):
            pieces.setdefault(hf_name, []).append((rows, value))
    return {hf_name: assemble(parts, hf_name) for hf_name, parts in pieces.items()}
