"""Which transformer layers, and whether the embedding (E) and the loss (L), each pipeline stage holds.

Megatron-LM's five ways to place layers, with Megatron's semantics (``megatron/core/transformer/
pipeline_parallel_layer_layout.py``, ``transformer_block.get_num_layers_to_build`` and
``transformer_config.__post_init__``):

* even (the default): ``num_layers / (p·v)`` layers per virtual stage;
* ``--decoder-first-pipeline-num-layers F`` / ``--decoder-last-pipeline-num-layers K``: the first (last)
  pipeline RANK holds F (K) layers, split evenly over its v chunks; the remaining layers are split evenly
  over the middle ranks (each rank's count divisible by v);
* ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``: the
  embedding (loss) counts as one layer in the even split, so the first (last) virtual stage builds one
  transformer layer fewer (``num_layers + 1`` or ``+ 2`` must divide by p, each rank's share by v);
* ``--pipeline-model-parallel-layout``: Megatron's layout string, ``E`` the embedding, ``t`` a transformer
  layer, ``L`` the loss (final norm, output layer, cross-entropy), ``|`` between stages, ``,`` ignored,
  ``x*n`` and ``(...)*n`` repeats (no nesting, as in Megatron). It lists the p·v virtual stages in
  pipeline order, so it sets v = stages / p; for Megatron's interleaving stage s is chunk s // p of rank
  s % p (for the V schedules, wherever the placement puts stage s). ``m`` is a multi-token prediction
  module: ptdp places them all on the last stage, before L (``tmL``, ``|mL``); Megatron's
  standalone MTP stage (``m|L``) is not supported.

Every way gives a list of :class:`Stage`, one per virtual stage in pipeline order, with the layers
numbered consecutively along the pipeline; E always opens stage 0 and L closes the last one (the
executor reads microbatches on stage 0 and computes the loss on the last). Pure: plain numbers and a layout
string in, stages out; no torch, no process group, no flag. Whether the user's flags add up is checked, one line
naming the flag, by ``ptdp.config.validate_pipeline`` before anything here runs; what this module refuses
itself (a :class:`LayoutError`) is only what it cannot compute: an unknown symbol, or counts that do not place
every layer once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ptdp.schedule.actions import stage_location


class LayoutError(ValueError):
    """Stages that cannot be computed from the numbers given (a caller's bug: the configuration's check,
    ``ptdp.config.validate_pipeline``, refuses them first with a line naming the flag)."""


@dataclass(frozen=True)
class Stage:
    """One virtual pipeline stage: its transformer layers (global indices) and whether it holds E / L."""

    layers: tuple[int, ...]
    embedding: bool = False
    loss: bool = False

    def symbols(self) -> str:
        return ("E" if self.embedding else "") + "t" * len(self.layers) + ("L" if self.loss else "")


SYMBOLS = "EtmL"  # the embedding, a transformer layer, an MTP module, the loss ("|" between stages, "x*n", "(...)*n")


def expand(text: str) -> str:
    """Megatron's unrolling: commas dropped, then ``(...)*n``, then ``x*n`` (one pass each, no nesting)."""
    text = text.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda g: g.group(1) * int(g.group(2)), text)
    return re.sub(r"(.)\*(\d+)", lambda g: g.group(1) * int(g.group(2)), text)


def parse_layout(text: str) -> list[str]:
    """The symbols of each stage of a layout string, e.g. ``"Et*3|(tt|)*2,L"`` -> ``["Ettt", "tt", "tt", "L"]``."""
    stages = expand(text).split("|")
    unknown = set("".join(stages)) - set(SYMBOLS)
    if unknown:
        raise LayoutError(f"layout {text!r}: unknown symbol(s) {''.join(sorted(unknown))!r}; the symbols are {SYMBOLS}")
    return stages


def stages_from_string(text: str, num_layers: int, p: int) -> list[Stage]:
    """The stages of layout string ``text`` for a model of ``num_layers`` layers on p pipeline ranks."""
    stages = parse_layout(text)
    flat = "".join(stages)
    if (len(stages) % p or flat.count("t") != num_layers or flat.count("E") != 1 or flat.count("L") != 1
            or not stages[0].startswith("E") or not stages[-1].endswith("L")
            or flat.count("m") != stages[-1].count("m") or "mt" in stages[-1]):
        raise LayoutError(f"layout {text!r} does not place {num_layers} layers on a multiple of p={p} stages with "
                          "E opening the first, L closing the last and any m (MTP) after its layers")
    return stages_from_counts([s.count("t") for s in stages])


def stages_from_counts(counts: Sequence[int]) -> list[Stage]:
    """Stages holding ``counts[s]`` consecutive layers each; E on the first, L on the last."""
    out, start = [], 0
    for s, n in enumerate(counts):
        out.append(Stage(tuple(range(start, start + n)), embedding=s == 0, loss=s == len(counts) - 1))
        start += n
    return out


def _uneven_counts(num_layers: int, p: int, v: int, first: int | None, last: int | None,
                   placement: str = "loop") -> list[int]:
    """Per-virtual-stage counts of ``--decoder-first/last-pipeline-num-layers`` (Megatron's offsets: chunk
    j of rank r holds the rank's count / v, layers numbered along the p·v stages; under a V placement
    pipeline rank 0 is the one holding both ends)."""
    middle_ranks = p - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    ranks = [middle_layers // middle_ranks if middle_ranks > 0 else 0] * p
    if first is not None:
        ranks[0] = first
    if last is not None:
        ranks[-1] = last
    return [ranks[stage_location(s, p, placement)[0]] // v for s in range(p * v)]


def _accounted_counts(num_layers: int, p: int, v: int, embedding: bool, loss: bool) -> list[int]:
    """Per-virtual-stage counts with the embedding and/or loss counted as a layer of the even split."""
    counts = [(num_layers + embedding + loss) // (p * v)] * (p * v)
    counts[0] -= embedding
    counts[-1] -= loss
    return counts


def pipeline_stages(num_layers: int, p: int, v: int, first: int | None = None, last: int | None = None,
                    account_embedding: bool = False, account_loss: bool = False,
                    layout: str | None = None, placement: str = "loop") -> list[Stage]:
    """The p·v stages of a configuration (Megatron's semantics, see the module docstring): ``layout``, else
    ``first``/``last``, else the ``account_*`` split, else even; ``placement`` (the schedule's) says which
    pipeline rank is the first/last-stage rank of each stage.

    LayoutError if the numbers do not place every layer exactly once on p·v stages.
    """
    if layout is not None:
        counts = [len(s.layers) for s in stages_from_string(layout, num_layers, p)]
    elif first is not None or last is not None:
        counts = _uneven_counts(num_layers, p, v, first, last, placement)
    elif account_embedding or account_loss:
        counts = _accounted_counts(num_layers, p, v, account_embedding, account_loss)
    else:
        counts = [num_layers // (p * v)] * (p * v)
    if len(counts) != p * v or min(counts) < 0 or sum(counts) != num_layers:
        raise LayoutError(f"{counts} layers per stage do not place {num_layers} layers on p x v = {p}x{v} stages")
    return stages_from_counts(counts)


def layout_string(stages: Sequence[Stage], mtp: int = 0) -> str:
    """The compact Megatron layout string of ``stages`` (runs of t as ``t*n``, repeated stages as
    ``(...|)*n``; ``mtp`` MTP modules before L), which :func:`stages_from_string` reads back to the same
    stages."""
    parts = []
    for s in stages:
        n = len(s.layers)
        body = "t" * n if n <= 2 else f"t*{n}"
        parts.append(("E" if s.embedding else "") + body + ("m" * mtp + "L" if s.loss else ""))
    out, i = [], 0
    while i < len(parts) - 1:  # the last stage (the only one with L) is never part of a repeat
        j = i
        while j + 1 < len(parts) - 1 and parts[j + 1] == parts[i]:
            j += 1
        out.append(f"({parts[i]}|)*{j - i + 1}" if j > i else parts[i] + "|")
        i = j + 1
    return "".join(out) + parts[-1]


def stage_work(stages: Sequence[Stage], p: int, embedding_cost: float = 0.0, output_cost: float = 0.0,
               vocab_parallel: bool = False, layer_cost: Sequence[float] | None = None) -> list[float]:
    """Work of each virtual stage in units of one transformer layer: its layers (layer i costing
    ``layer_cost[i]``, default 1: sliding-window layers cost less), plus the embedding (output layer with the
    loss) at ``embedding_cost`` (``output_cost``) layers on the stage holding E (L), or with vocabulary
    parallelism 1/p of both on every rank, spread over the rank's chunks (``ptdp simulate``)."""
    work = [float(len(s.layers)) if layer_cost is None else float(sum(layer_cost[i] for i in s.layers))
            for s in stages]
    if vocab_parallel and p > 1:
        share = (embedding_cost + output_cost) / p / (len(stages) // p)
        return [w + share for w in work]
    for i, s in enumerate(stages):
        work[i] += embedding_cost * s.embedding + output_cost * s.loss
    return work
