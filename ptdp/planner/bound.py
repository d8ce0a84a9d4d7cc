"""``ptdp plan``'s search without pricing every layout: the same answer as ``search(configs=...)`` over
the whole space, found by branch and bound (Mixtral-8x7B on 64 GPUs priced 303,012 layouts).

The answer depends on few layouts: the plan shows the fastest layout that fits and, for each other
(t, p, c, e), its fastest layout, in the order of the first ``top + 1`` groups. So

* **bounds first**: every layout gets a lower bound on its iteration time (``LowerBound``) from the costs
  that grow with the layers a rank holds, which no vocabulary variant or ZeRO stage can lower; the
  layouts are visited from the lowest bound up, and a layout whose bound exceeds both its group's fastest
  so far and the ``top + 1``-th fastest group so far cannot change the answer;
* **memory before time**: a layout that does not fit is never priced (its memory estimate is cheap);
* **dominated layouts**: the vocabulary variants of a layout share its bound, so they are visited (and
  built: their balanced layout costs two stage estimates) only when it survives; so do its overlapped
  variants (combined 1F1B, dualpipev), whose bound hides what the overlap can hide.

Only when fewer than ``top + 1`` groups fit does the answer need the fastest layouts that do not fit; a
second pass finds those the same way. Ties keep ``candidates``' order, as the full search's stable sort.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import replace

from ptdp.config.optimizers import optimizer_spec
from ptdp.planner import experts
from ptdp.planner.estimate import Estimate, SearchResult, evaluate, ranked_result
from ptdp.planner.memory import (
    RUNTIME_OVERHEAD_BYTES,
    activation_bytes_per_layer,
    activation_microbatches_in_flight,
    layer_parameters_per_rank,
    memory_per_gpu,
    model_state_bytes_per_param,
    step_buffer_bytes_per_param,
)
from ptdp.planner.perf import rank_stage_times
from ptdp.planner.space import Cell, Space, cells, invalid_reason, overlap_variants
from ptdp.planner.spec import ClusterSpec, GPTSpec, ParallelConfig, TrainingSpec
from ptdp.planner.vocab import vocab_variants
from ptdp.schedule.registry import bubble_fraction_formula, default_schedule

# A bound computed in another order of floating-point operations than the estimate it bounds
_SAFETY = 1 - 1e-9


class LowerBound:
    """A lower bound on the iteration time of every layout of a cell with its expert layout j.

    The slowest pipeline rank costs at least the mean rank: l/p layers of forward, backward,
    recomputation, context-parallel and expert-dispatch time per microbatch, plus its v chunks' p2p
    (``perf._stage``: each linear in the rank's layers, the same p2p on every rank). An uneven layout moves
    layers between ranks (the mean stays), vocabulary parallelism adds traffic, the ZeRO stage changes only
    memory, the data-parallel step and the optimizer (all >= 0). The iteration is m microbatches of the
    slowest rank plus the bubble, (p-1)/(v·m) (or the schedule's own fraction) of them. Where the space
    holds overlapped variants (``overlaps``), the expert dispatch counts only beyond the compute that can
    hide it (``perf.overlap_hidden``) and the bubble and stashes are the least of the base and dualpipev."""

    def __init__(self, model: GPTSpec, cluster: ClusterSpec, train: TrainingSpec, space: Space) -> None:
        self.model, self.cluster, self.train, self.space = model, cluster, train, space
        self._per_layer: dict[tuple, float] = {}
        self._hop: dict[tuple, float] = {}
        self._bubble: dict[tuple, float] = {}
        self._states: dict[tuple, float] = {}

    def _stage(self, cell: Cell, j: int, p: int):
        e, etp, dispatcher = cell.experts[j]
        cfg = ParallelConfig(cell.t, p, cell.d, 1, cell.b, cell.recompute, False,
                             self.space.sequence_parallel and cell.t > 1, None, context_parallel_size=cell.c,
                             cp_comm_type=self.space.cp_comm_type, expert_model_parallel_size=e,
                             expert_tensor_parallel_size=etp, moe_token_dispatcher_type=dispatcher)
        return rank_stage_times(self.model, cfg, self.cluster, self.train.precision, [0])[0]

    def overlaps(self, cell: Cell, j: int) -> bool:
        """Whether layouts of the cell with expert layout j may overlap their expert communication."""
        return self.model.moe is not None and cell.experts[j][0] > 1 and (
            self.space.overlap or self.space.searches_overlap() or self.space.pipeline_schedule == "dualpipev")

    def per_layer(self, cell: Cell, j: int) -> float:
        """Seconds per layer per microbatch that no layout of the cell avoids (from a one-stage layout)."""
        key = (cell.t, cell.c, cell.b, cell.recompute, cell.experts[j])
        if key not in self._per_layer:
            st = self._stage(cell, j, 1)
            ep = max(0.0, st.ep_comm - st.compute) if self.overlaps(cell, j) else st.ep_comm
            self._per_layer[key] = (st.compute + st.recompute + st.cp_comm + ep) / self.model.num_layers
        return self._per_layer[key]

    def hop(self, cell: Cell) -> float:
        """One chunk's p2p per microbatch (forward and backward) on every rank (0 at p = 1)."""
        key = (cell.t, cell.c, cell.p, cell.d, cell.b)
        if key not in self._hop:
            self._hop[key] = self._stage(cell, 0, cell.p).p2p if cell.p > 1 else 0.0
        return self._hop[key]

    def bubble(self, p: int, v: int, m: int, overlaps: bool = False) -> float:
        key = (p, v, m, overlaps)
        if key not in self._bubble:
            fraction = math.inf
            for name in self._schedules(v, overlaps):
                try:
                    fraction = min(fraction, bubble_fraction_formula(p, v, m, name))
                except (ValueError, ZeroDivisionError):  # no such schedule: no such layout
                    continue
            self._bubble[key] = max(fraction if fraction < math.inf else 0.0, 0.0)  # none valid: invalid anyway
        return self._bubble[key]

    def _schedules(self, v: int, overlaps: bool) -> list[str]:
        """The schedules a cell's layouts may run: the space's, and dualpipev among the overlapped variants."""
        names = [default_schedule(self.space.pipeline_schedule, v)]
        return names + ["dualpipev"] if overlaps and v == 2 and self.space.searches_overlap() else names

    def memory(self, cell: Cell, j: int) -> float:
        """Bytes the fullest rank holds at least: those of the mean rank (``memory.rank_memory``), l/p layers'
        model states and ZeRO step buffers under the cell's lightest ZeRO stage, the runtime overhead, and
        the fewest stashes any rank keeps of l/(p·v) layers each (no vocabulary layers)."""
        cfg = cell.config(0, j)
        per_layer = self._layer_states(cell, j)
        stash = activation_bytes_per_layer(self.model, cfg)
        working = activation_bytes_per_layer(self.model, cfg, stashed=False) if cell.recompute == "full" else 0.0
        m = self.train.global_batch_size // (cell.b * cell.d)
        stashes = math.inf
        for name in self._schedules(cell.v, self.overlaps(cell, j)):
            try:
                stashes = min(stashes, *(min(activation_microbatches_in_flight(name, cell.p, cell.v, m, r), m * cell.v)
                                         for r in range(cell.p)))
            except (ValueError, ZeroDivisionError):  # no such schedule: no such layout
                continue
        stashes = 0 if stashes == math.inf else stashes  # none valid: the layout is invalid anyway
        layers = self.model.num_layers / cell.p
        acts = stashes * layers / cell.v * stash + working
        return (RUNTIME_OVERHEAD_BYTES + layers * per_layer + acts) * _SAFETY

    def _layer_states(self, cell: Cell, j: int) -> float:
        """Model-state and step-buffer bytes of one mean layer on a rank, the least of the cell's shardings."""
        e, etp, _ = cell.experts[j]
        key = (cell.t, cell.c, cell.d, cell.shardings, e, etp)
        if key not in self._states:
            if self.model.moe is None:
                dense, expert = layer_parameters_per_rank(self.model, cell.t), 0.0
            else:
                dense, expert = experts.layer_parameters(self.model, cell.t, e, etp)
            precision, least = self.train.precision, math.inf
            state = optimizer_spec(self.train.optimizer).least_state_bytes  # Muon: its matrices' 4 for all
            for i in range(len(cell.shardings)):
                cfg = cell.config(i, j)
                least = min(least, dense * model_state_bytes_per_param(precision, cfg.strategy, cfg.shards, state)
                            + expert * model_state_bytes_per_param(precision, cfg.strategy, experts.expert_shards(cfg),
                                                                   state)
                            + (dense + expert) * step_buffer_bytes_per_param(precision, cfg.strategy))
            self._states[key] = least
        return self._states[key]

    def __call__(self, cell: Cell, j: int) -> float:
        m = self.train.global_batch_size // (cell.b * cell.d)
        if m < 1:
            return 0.0  # invalid (--global-batch-size): left to invalid_reason
        stage = self.per_layer(cell, j) * self.model.num_layers / cell.p + cell.v * self.hop(cell)
        return m * stage * (1 + self.bubble(cell.p, cell.v, m, self.overlaps(cell, j))) * _SAFETY


def group_of(cfg: ParallelConfig) -> tuple[int, ...]:
    """The plan shows one layout per (t, p, c, e)."""
    return (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.context_parallel_size,
            cfg.expert_model_parallel_size)


class _Fastest:
    """The fastest layout found so far per group, and the bound that prunes: a layout slower than its
    group's fastest, or than the ``needed``-th fastest group, changes nothing."""

    def __init__(self, needed: int) -> None:
        self.needed, self.best = needed, {}
        self._cut = math.inf

    def bound(self, group: tuple) -> float:
        mine = self.best[group][0] if group in self.best else math.inf
        return min(mine, self._cut)

    def offer(self, est: Estimate, order: tuple) -> None:
        group = group_of(est.config)
        if group not in self.best or (est.iteration_time_s, order) < self.best[group][:2]:
            self.best[group] = (est.iteration_time_s, order, est)
            if len(self.best) >= self.needed:
                self._cut = heapq.nsmallest(self.needed, (b[0] for b in self.best.values()))[-1]

    def ranked(self) -> list[Estimate]:
        return [b[2] for b in sorted(self.best.values(), key=lambda b: b[:2])]


def pruned_search(model: GPTSpec, cluster: ClusterSpec, train: TrainingSpec, space: Space, top: int = 5
                  ) -> SearchResult:
    """``search``'s answer over ``space`` (see the module docstring)."""
    bound = LowerBound(model, cluster, train, space)
    entries = sorted(((bound(cell, j), cell.index, j, cell) for cell in cells(model, cluster, train, space)
                      for j in range(len(cell.experts))), key=lambda x: x[:3])
    limit = cluster.gpu.memory_bytes
    fitting, unfit_groups, count = _Fastest(top + 1), set(), 0
    for lower, _, j, cell in entries:
        group = (cell.t, cell.p, cell.c, cell.experts[j][0])
        if lower > fitting.bound(group):
            continue
        if bound.memory(cell, j) > limit:  # no layout of the entry fits
            if invalid_reason(model, cell.config(0, j), cluster, train) is None:
                unfit_groups.add(group)
            continue
        for order, cfg in _layouts(model, cluster, train, cell, j):
            if lower > fitting.bound(group):
                break
            memory = memory_per_gpu(model, cfg, train.global_batch_size, train.precision, train.optimizer)
            count += 1
            if memory.total > limit:
                unfit_groups.add(group)
                continue
            fitting.offer(evaluate(model, cfg, cluster, train, memory), order)
    ranked = fitting.ranked()
    unfit_groups -= fitting.best.keys()
    missing = top + (1 if ranked else 0) - len(ranked)
    if missing > 0 and unfit_groups:  # the closest layouts that do not fit complete the list
        closest = _Fastest(missing)
        for lower, _, j, cell in entries:
            group = (cell.t, cell.p, cell.c, cell.experts[j][0])
            if group not in unfit_groups or lower > closest.bound(group):
                continue
            for order, cfg in _layouts(model, cluster, train, cell, j):
                if lower > closest.bound(group):
                    break
                closest.offer(evaluate(model, cfg, cluster, train), order)
                count += 1
        ranked += closest.ranked()
    return ranked_result(ranked, top, cluster, count)


def _layouts(model: GPTSpec, cluster: ClusterSpec, train: TrainingSpec, cell: Cell, j: int):
    """(order, layout) of every valid layout of the cell with expert layout j, in ``candidates``' order:
    each ZeRO sharding with its vocabulary variants (built once: the sharding does not change them), then
    its overlapped variants."""
    base = cell.config(0, j)
    if invalid_reason(model, base, cluster, train) is not None:  # validity does not depend on the sharding
        return
    variants = None
    for i in range(len(cell.shardings)):
        cfg = base if i == 0 else cell.config(i, j)
        yield (cell.index, i, j, 0), cfg
        if variants is None:
            variants = list(vocab_variants(model, base, cluster, train)) if cell.space.vocab_layouts else []
        for k, variant in enumerate(variants, start=1):
            yield (cell.index, i, j, k), replace(cfg, enable_vocab_parallel=variant.enable_vocab_parallel,
                                                 pipeline_model_parallel_layout=variant.pipeline_model_parallel_layout)
        if cell.space.searches_overlap():
            for k, variant in enumerate(overlap_variants(model, cfg, cluster, train), start=len(variants) + 1):
                yield (cell.index, i, j, k), variant
