"""Where ZeRO-3 gathers, frees and reduces a chunk's parameters, read off a rank's action list.

``plan_param_sync(actions, reshard_after_forward)`` is pure: it returns, per compute action index, the
operations to run before and after it. The executor performs them (``run_schedule(..., param_sync=)``)
and the NCCL model (``nccl_model``) inserts the same collectives into its event lists, so what runs is
what is proven deadlock-free.

* A chunk is *gathered* over a run of its compute actions: with ``reshard_after_forward`` False (the
  default, torchtitan's choice under pipeline parallelism) one run from its first to its last action of
  the step; with True a run is a maximal stretch of consecutive compute actions of that chunk, so it is
  freed whenever the rank turns to another chunk and gathered again at its next use.
* The gather is issued (asynchronously) before the compute action preceding the run -- a prefetch that
  overlaps that action -- and waited for right before the run.
* ``reduce``: the chunk's gradient buckets are reduced right after its last B/I/W of the list (for the
  zero-bubble schedules that is its last W: W passes accumulate weight gradients with the gathered
  weights), overlapping the rest of the schedule. A forward-only list has no reduce.
* Vocabulary parallelism (``ptdp.schedule.vocab``): EF, S, T and EB read the vocabulary slices, which are
  parameters of local chunk 0 (``vocab_stage.VocabSlices``), so they are uses of chunk 0 like its F/B/I/W
  (gathered before, kept gathered); T (the output-weight slice) and EB (the embedding slice, after the
  ``EMB_G`` exchange, last in the list) add gradients, so chunk 0 is reduced only after the later of
  them -- EB, in a training list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ptdp.schedule.actions import COMPUTE_OPS, Action
from ptdp.schedule.vocab import VOCAB_COMPUTE

USES = COMPUTE_OPS | VOCAB_COMPUTE  # the actions that read a chunk's parameters (vocabulary ones: chunk 0)
GRAD_OPS = frozenset({"B", "I", "W", "T", "EB"})  # ... and those that add to its gradients

SYNC_OPS = ("gather", "wait", "release", "reduce")


@dataclass(frozen=True)
class SyncOp:
    op: str  # gather (start, async) | wait (until gathered) | release (free) | reduce (start grad reduction)
    chunk: int


def plan_param_sync(actions: Sequence[Action], reshard_after_forward: bool = False
                    ) -> tuple[dict[int, list[SyncOp]], dict[int, list[SyncOp]]]:
    """``(before, after)``: the ops to run before and after the compute (or vocabulary compute) action
    at each index of ``actions``."""
    compute = [i for i, a in enumerate(actions) if a.op in USES]
    runs: list[tuple[int, int, int]] = []  # (chunk, first position, last position) in ``compute``
    if reshard_after_forward:
        for pos, i in enumerate(compute):
            c = actions[i].chunk
            if runs and runs[-1][0] == c and runs[-1][2] == pos - 1:
                runs[-1] = (c, runs[-1][1], pos)
            else:
                runs.append((c, pos, pos))
    else:
        span: dict[int, list[int]] = {}
        for pos, i in enumerate(compute):
            span.setdefault(actions[i].chunk, [pos, pos])[1] = pos
        runs = sorted(((c, lo, hi) for c, (lo, hi) in span.items()), key=lambda r: r[1])
    before: dict[int, list[SyncOp]] = {}
    after: dict[int, list[SyncOp]] = {}
    for c, lo, hi in runs:
        issue = compute[lo - 1] if lo > 0 else compute[lo]  # prefetch one compute action early
        before.setdefault(issue, []).append(SyncOp("gather", c))
        before.setdefault(compute[lo], []).append(SyncOp("wait", c))
        after.setdefault(compute[hi], []).append(SyncOp("release", c))
    last_grad: dict[int, int] = {}
    training = any(a.op in ("B", "I", "W") for a in actions)  # a forward-only list's T adds no gradient
    for i in compute:
        if training and actions[i].op in GRAD_OPS:
            last_grad[actions[i].chunk] = i
    for c, i in last_grad.items():
        after.setdefault(i, []).insert(0, SyncOp("reduce", c))
    for ops in before.values():  # gathers waited for right here, the waits, then the prefetches
        waited = {s.chunk for s in ops if s.op == "wait"}
        ops.sort(key=lambda s: 1 if s.op == "wait" else 0 if s.chunk in waited else 2)
    return before, after
