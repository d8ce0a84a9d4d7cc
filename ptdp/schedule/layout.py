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
  s % p (for the V schedules, wherever the placement puts stage s). ``m`` (multi-token prediction) is
  not supported.

Every way gives a list of :class:`Stage`, one per virtual stage in pipeline order, with the layers
numbered consecutively along the pipeline; E always opens stage 0 and L closes the last one (the
executor reads microbatches on stage 0 and computes the loss on the last). Problems raise
:class:`LayoutError`, one line naming the flag. Pure: no torch, no process group.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ptdp.schedule.actions import stage_location
from ptdp.schedule.registry import default_schedule, schedule_placement

LAYOUT_FLAG = "--pipeline-model-parallel-layout"
FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"
EMBEDDING_FLAG = "--account-for-embedding-in-pipeline-split"
LOSS_FLAG = "--account-for-loss-in-pipeline-split"


class LayoutError(ValueError):
    """A layout that does not add up: the message is one line naming the flag."""


@dataclass(frozen=True)
class Stage:
    """One virtual pipeline stage: its transformer layers (global indices) and whether it holds E / L."""

    layers: tuple[int, ...]
    embedding: bool = False
    loss: bool = False

    def symbols(self) -> str:
        return ("E" if self.embedding else "") + "t" * len(self.layers) + ("L" if self.loss else "")


def expand(text: str) -> str:
    """Megatron's unrolling: commas dropped, then ``(...)*n``, then ``x*n`` (one pass each, no nesting)."""
    text = text.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda g: g.group(1) * int(g.group(2)), text)
    return re.sub(r"(.)\*(\d+)", lambda g: g.group(1) * int(g.group(2)), text)


def parse_layout(text: str) -> list[str]:
    """The symbols of each stage of a layout string, e.g. ``"Et*3|(tt|)*2,L"`` -> ``["Ettt", "tt", "tt", "L"]``."""
    stages = expand(text).split("|")
    for symbol in sorted(set("".join(stages))):
        if symbol == "m":
            raise LayoutError(f"{LAYOUT_FLAG} {text!r}: 'm' (multi-token prediction layers) is not supported "
                              "by ptdp; use E, t and L")
        if symbol not in "EtL":
            raise LayoutError(f"{LAYOUT_FLAG} {text!r}: unknown symbol {symbol!r}; use E (embedding), t (layer), "
                              "L (loss), | between stages, x*n or (...)*n to repeat")
    return stages


def layout_num_stages(text: str) -> int:
    """The number of virtual stages (p·v) of a layout string (LayoutError if it does not parse)."""
    return len(parse_layout(text))


def stages_from_string(text: str, num_layers: int, p: int) -> list[Stage]:
    """The stages of layout string ``text`` for a model of ``num_layers`` layers on p pipeline ranks."""
    stages = parse_layout(text)
    flat = "".join(stages)
    if len(stages) % p:
        raise LayoutError(f"{LAYOUT_FLAG} {text!r} has {len(stages)} stages, not a multiple of "
                          f"--pipeline-model-parallel-size {p} (it lists the p x v virtual stages)")
    if flat.count("t") != num_layers:
        raise LayoutError(f"{LAYOUT_FLAG} {text!r} places {flat.count('t')} transformer layers (t), but "
                          f"--num-layers is {num_layers}")
    if flat.count("E") != 1 or not stages[0].startswith("E"):
        raise LayoutError(f"{LAYOUT_FLAG} {text!r}: the embedding E must appear once, at the start of the "
                          "first stage")
    if flat.count("L") != 1 or not stages[-1].endswith("L"):
        raise LayoutError(f"{LAYOUT_FLAG} {text!r}: the loss L must appear once, at the end of the last stage")
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
    for flag, value in ((FIRST_FLAG, first), (LAST_FLAG, last)):
        if value is not None and value <= 0:
            raise LayoutError(f"{flag} must be > 0, got {value}")
        if value is not None and value % v:
            raise LayoutError(f"{flag} {value} must be divisible by the virtual pipeline size {v} (each of the "
                              f"rank's {v} chunks gets the same number of layers)")
    middle_ranks = p - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    flags = " and ".join(f"{f} {x}" for f, x in ((FIRST_FLAG, first), (LAST_FLAG, last)) if x is not None)
    if middle_ranks < 0 or middle_layers < 0 or bool(middle_layers) != bool(middle_ranks):
        raise LayoutError(f"{flags} leave {middle_layers} of --num-layers {num_layers} for {max(middle_ranks, 0)} "
                          f"middle pipeline ranks of --pipeline-model-parallel-size {p}: each middle rank needs "
                          "layers, and layers need a middle rank")
    per_rank = middle_layers // middle_ranks if middle_ranks else 0
    if middle_ranks and (middle_layers % middle_ranks or per_rank % v):
        raise LayoutError(f"{flags} leave {middle_layers} layers for {middle_ranks} middle pipeline ranks: "
                          f"they must split evenly, into {v} equal chunk(s) per rank (the virtual size)")
    ranks = [per_rank] * p
    if first is not None:
        ranks[0] = first
    if last is not None:
        ranks[-1] = last
    return [ranks[stage_location(s, p, placement)[0]] // v for s in range(p * v)]


def _accounted_counts(num_layers: int, p: int, v: int, embedding: bool, loss: bool) -> list[int]:
    """Per-virtual-stage counts with the embedding and/or loss counted as a layer of the even split."""
    total = num_layers + embedding + loss
    names = " and ".join(f for f, on in ((EMBEDDING_FLAG, embedding), (LOSS_FLAG, loss)) if on)
    if total % (p * v):
        raise LayoutError(f"{names}: --num-layers {num_layers} + {embedding + loss} = {total} must be divisible by "
                          f"--pipeline-model-parallel-size x virtual size = {p}x{v}")
    counts = [total // (p * v)] * (p * v)
    counts[0] -= embedding
    counts[-1] -= loss
    if min(counts) < 0:
        raise LayoutError(f"{names}: too few layers for {p * v} virtual stages")
    return counts


def pipeline_stages(num_layers: int, p: int, v: int, first: int | None = None, last: int | None = None,
                    account_embedding: bool = False, account_loss: bool = False,
                    layout: str | None = None, placement: str = "loop") -> list[Stage]:
    """The p·v stages of a configuration (Megatron's semantics, see the module docstring); ``placement``
    (the schedule's) says which pipeline rank is the first/last-stage flags' rank of each stage.

    LayoutError (one line, naming the flag) if the flags cannot be combined or do not add up.
    """
    uneven, accounted = first is not None or last is not None, account_embedding or account_loss
    if layout is not None:
        given = [f for f, on in ((FIRST_FLAG, first is not None), (LAST_FLAG, last is not None),
                                 (EMBEDDING_FLAG, account_embedding), (LOSS_FLAG, account_loss)) if on]
        if given:
            raise LayoutError(f"{LAYOUT_FLAG} places every layer itself: drop {', '.join(given)}")
        stages = stages_from_string(layout, num_layers, p)
        if len(stages) != p * v:
            raise LayoutError(f"{LAYOUT_FLAG} {layout!r} has {len(stages)} stages, but --pipeline-model-parallel-"
                              f"size x --virtual-pipeline-model-parallel-size = {p}x{v} = {p * v}")
        return stages
    if uneven and accounted:
        raise LayoutError(f"{FIRST_FLAG}/{LAST_FLAG} cannot be combined with {EMBEDDING_FLAG} or {LOSS_FLAG} "
                          "(as in Megatron-LM); use one way, or a --pipeline-model-parallel-layout")
    if uneven:
        return stages_from_counts(_uneven_counts(num_layers, p, v, first, last, placement))
    if accounted:
        return stages_from_counts(_accounted_counts(num_layers, p, v, account_embedding, account_loss))
    if num_layers % (p * v):
        raise LayoutError(f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size x "
                          f"virtual size = {p}x{v}; choose sizes so every model chunk gets the same layers, or "
                          f"place them with {FIRST_FLAG}/{LAST_FLAG} or {LAYOUT_FLAG}")
    return stages_from_counts([num_layers // (p * v)] * (p * v))


def stages_of(model, parallel, p: int | None = None, v: int | None = None) -> list[Stage]:
    """:func:`pipeline_stages` of a ``ModelConfig`` and ``ParallelConfig`` (read by attribute: the
    configuration imports this package, not the other way round)."""
    p, v = p or parallel.pipeline_model_parallel_size, v or parallel.virtual_size
    schedule = getattr(parallel, "schedule", None) or default_schedule(getattr(parallel, "pipeline_schedule", None), v)
    return pipeline_stages(
        model.num_layers, p, v,
        getattr(parallel, "decoder_first_pipeline_num_layers", None),
        getattr(parallel, "decoder_last_pipeline_num_layers", None),
        getattr(parallel, "account_for_embedding_in_pipeline_split", False),
        getattr(parallel, "account_for_loss_in_pipeline_split", False),
        getattr(parallel, "pipeline_model_parallel_layout", None), schedule_placement(schedule))


def is_even(stages: Sequence[Stage]) -> bool:
    """Every stage holds the same number of transformer layers (the default split)."""
    return len({len(s.layers) for s in stages}) == 1


def layout_string(stages: Sequence[Stage]) -> str:
    """The compact Megatron layout string of ``stages`` (runs of t as ``t*n``, repeated stages as
    ``(...|)*n``), which :func:`stages_from_string` reads back to the same stages."""
    parts = []
    for s in stages:
        n = len(s.layers)
        body = "t" * n if n <= 2 else f"t*{n}"
        parts.append(("E" if s.embedding else "") + body + ("L" if s.loss else ""))
    out, i = [], 0
    while i < len(parts) - 1:  # the last stage (the only one with L) is never part of a repeat
        j = i
        while j + 1 < len(parts) - 1 and parts[j + 1] == parts[i]:
            j += 1
        out.append(f"({parts[i]}|)*{j - i + 1}" if j > i else parts[i] + "|")
        i = j + 1
    return "".join(out) + parts[-1]


def stage_work(stages: Sequence[Stage], p: int, embedding_cost: float = 0.0, output_cost: float = 0.0,
               vocab_parallel: bool = False) -> list[float]:
    """Work of each virtual stage in units of one transformer layer: its layers, plus the embedding (output
    layer with the loss) at ``embedding_cost`` (``output_cost``) layers on the stage holding E (L), or with
    vocabulary parallelism 1/p of both on every rank, spread over the rank's chunks (``ptdp simulate``)."""
    work = [float(len(s.layers)) for s in stages]
    if vocab_parallel and p > 1:
        share = (embedding_cost + output_cost) / p / (len(stages) // p)
        return [w + share for w in work]
    for i, s in enumerate(stages):
        work[i] += embedding_cost * s.embedding + output_cost * s.loss
    return work
