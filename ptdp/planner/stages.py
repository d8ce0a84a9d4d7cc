"""Per pipeline rank: how many transformer layers, and which share of the vocabulary layers, it holds.

The vocabulary layers unbalance a pipeline: the first stage holds the input embedding, the
last the output layer and the softmax cross-entropy, each V x h. Two cures, both modelled here:

* an uneven layout (Megatron's ``--pipeline-model-parallel-layout`` or first/last-stage flags): fewer
  transformer layers on the ranks that hold E and L (:func:`rank_layers`, from ``ptdp.schedule.layout``);
* vocabulary parallelism (Yeung et al., 2024; ``--enable-vocab-parallel``): both vocabulary layers split
  by vocabulary over all p ranks, so each rank does 1/p of their work and holds 1/p of their weights
  (:func:`vocab_shares`), at the price of the all-reduce barriers that join the slices
  (:func:`vocab_parallel_messages`).

:func:`balanced_counts` finds the layout that evens out the per-rank time given a layer's cost and the
vocabulary layers' costs (what ``ptdp plan`` proposes). Pure arithmetic: no torch.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Sequence

from ptdp.planner.spec import ParallelConfig
from ptdp.schedule.actions import stage_location
from ptdp.schedule.actions import virtual_stage as stage_location_inverse
from ptdp.schedule.layout import layout_string, stages_from_counts, stages_from_string
from ptdp.schedule.registry import schedule_placement


def _sizes(cfg: ParallelConfig) -> tuple[int, int, str]:
    return (cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size,
            schedule_placement(cfg.schedule))


def rank_layers(num_layers: int, cfg: ParallelConfig) -> list[float]:
    """Transformer layers on each pipeline rank (all its chunks), where the schedule's placement puts them."""
    p, v, placement = _sizes(cfg)
    return list(_rank_layers(num_layers, p, v, placement, cfg.pipeline_model_parallel_layout))


@functools.lru_cache(maxsize=4096)  # the planner asks for every rank of thousands of layouts
def _rank_layers(num_layers: int, p: int, v: int, placement: str, layout: str | None) -> tuple[float, ...]:
    if not layout:
        return (num_layers / p,) * p
    out = [0.0] * p
    for s, stage in enumerate(stages_from_string(layout, num_layers, p)):
        out[stage_location(s, p, placement)[0]] += len(stage.layers)
    return tuple(out)


def end_ranks(cfg: ParallelConfig) -> tuple[int, int]:
    """The pipeline ranks holding the first and the last virtual stage (the last is rank 0 under a V)."""
    p, v, placement = _sizes(cfg)
    return stage_location(0, p, placement)[0], stage_location(p * v - 1, p, placement)[0]


def vocab_shares(cfg: ParallelConfig, rank: int) -> tuple[float, float]:
    """(share of the input embedding, share of the output layer + loss) that ``rank`` computes and holds:
    1/p each with vocabulary parallelism, else 1 on the rank holding the first (last) virtual stage."""
    p = cfg.pipeline_model_parallel_size
    if cfg.enable_vocab_parallel and p > 1:
        return 1 / p, 1 / p
    first, last = end_ranks(cfg)
    return float(rank == first), float(rank == last)


def is_uniform(cfg: ParallelConfig) -> bool:
    """Even layers and no vocabulary parallelism: the first and last rank bound every other one."""
    return not cfg.pipeline_model_parallel_layout and not cfg.enable_vocab_parallel


def ranks_to_check(cfg: ParallelConfig, num_layers: int | None = None) -> list[int]:
    """The pipeline ranks whose time can be the largest: the first and last under the even split, else one
    rank of each kind (its layers, its vocabulary shares, whether it holds an end), or all without
    ``num_layers``."""
    p = cfg.pipeline_model_parallel_size
    if is_uniform(cfg):
        return sorted({0, p - 1})
    if num_layers is None:
        return list(range(p))
    layers, ends, kinds = rank_layers(num_layers, cfg), end_ranks(cfg), {}
    for r in range(p):
        kinds.setdefault(rank_kind(cfg, r, layers, ends), r)
    return sorted(kinds.values())


def rank_kind(cfg: ParallelConfig, rank: int, layers: Sequence[float], ends: tuple[int, int]) -> tuple:
    """What a rank's time and parameters depend on: two ranks of one kind cost the same."""
    return layers[rank], vocab_shares(cfg, rank), rank == ends[0], rank == ends[1]


def vocab_parallel_messages(cfg: ParallelConfig) -> int:
    """All-reduces of one microbatch's b·s·h activations over the pipeline group that vocabulary parallelism
    adds per microbatch: the embedding's partial outputs (forward), the last hidden state to every rank and
    the input-gradient contributions back (C1); the max / sum-of-exp barrier (C0) is b·s floats, fused into
    C1 with one barrier. Counted as exposed time, though the paper overlaps them with transformer layers."""
    if not cfg.enable_vocab_parallel or cfg.pipeline_model_parallel_size == 1:
        return 0
    return 3


def vocab_parallel_extra_stashes(cfg: ParallelConfig) -> int:
    """Extra microbatches of activations vocabulary parallelism keeps under 1F1B (Yeung et al.): p + 2
    instead of p with one barrier, p + 1 with two (``--disable-fb-fusion``)."""
    if not cfg.enable_vocab_parallel or cfg.pipeline_model_parallel_size == 1:
        return 0
    return 1 if cfg.disable_fb_fusion else 2


def balanced_counts(num_layers: int, p: int, v: int, placement: str, layer_cost: float, first_cost: float,
                    last_cost: float) -> list[int]:
    """Layers per virtual stage (in pipeline order) that minimise the slowest rank's time, each layer costing
    ``layer_cost`` and the ranks holding the first (last) stage ``first_cost`` (``last_cost``) more.

    Greedy per rank (each layer to the least loaded rank: optimal for equal-cost items), then each rank's
    layers spread evenly over its v chunks, the remainder away from the chunks holding E and L. Only the
    per-stage counts matter: the layers stay consecutive along the pipeline.
    """
    first, last = stage_location(0, p, placement)[0], stage_location(p * v - 1, p, placement)[0]
    heap = [(first_cost * (r == first) + last_cost * (r == last), r) for r in range(p)]
    heapq.heapify(heap)
    per_rank = [0] * p
    for _ in range(num_layers):
        load, r = heapq.heappop(heap)
        per_rank[r] += 1
        heapq.heappush(heap, (load + layer_cost, r))
    counts = [0] * (p * v)
    for r in range(p):
        stages = sorted((stage_location_inverse(r, c, p, placement) for c in range(v)),
                        key=lambda s: (s in (0, p * v - 1), s))  # the E / L chunks last in line for extras
        base, extra = divmod(per_rank[r], v)
        for i, s in enumerate(stages):
            counts[s] = base + (i < extra)
    return counts


def balanced_layout(num_layers: int, p: int, v: int, placement: str, layer_cost: float, first_cost: float,
                    last_cost: float, mtp: int = 0) -> str | None:
    """:func:`balanced_counts` as a Megatron layout string (``mtp`` MTP modules on the last stage), or None
    when it is the even split."""
    counts = balanced_counts(num_layers, p, v, placement, layer_cost, first_cost, last_cost)
    if len(set(counts)) == 1:
        return None
    return layout_string(stages_from_counts(counts), mtp)


def per_rank(values: Sequence[float]) -> str:
    """``[1.0, 2.5]`` as ``"1.00 2.50"`` (the planner's per-rank lines)."""
    return " ".join(f"{x:.2f}" for x in values)
