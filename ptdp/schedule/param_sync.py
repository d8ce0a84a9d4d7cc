"""Where ZeRO-3 gathers, frees and reduces a chunk's parameters: actions inserted into a rank's list.

``add_param_sync(actions, reshard_after_forward)`` is pure: it returns the list with four more kinds of
action, each naming a local chunk. The executor runs them through the handlers the ZeRO-3 gatherer
registers (``ptdp.parallel.data.zero``), the NCCL model (``ptdp.simulate.nccl.zero``) records the
collectives of the same list, and the simulator reads it too, so what runs is what is proven deadlock-free.

* ``GATHER_PARAMS`` starts (asynchronously) the all-gather of a chunk's parameter shards;
  ``WAIT_PARAMS`` waits for it; ``RELEASE_PARAMS`` frees the gathered parameters; ``REDUCE_GRADS`` starts
  the data-parallel reduction of the chunk's gradients (waited for at the step's gradient sync).
* A chunk is gathered over a run of the actions that read its parameters (:data:`PARAM_USES`): with
  ``reshard_after_forward`` False (the default, torchtitan's choice under pipeline parallelism) one run
  from its first to its last use of the step; with True a run is a maximal stretch of consecutive uses of
  that chunk, so it is freed whenever the rank turns to another chunk and gathered again at its next use.
* The gather is issued before the use preceding the run -- a prefetch that overlaps that action -- and
  waited for right before the run; the release follows the run's last use.
* The reduction follows the chunk's last gradient-producing use (for the zero-bubble schedules its last W:
  W passes accumulate weight gradients with the gathered weights), overlapping the rest of the schedule. A
  forward-only list has no reduction.
* Vocabulary parallelism (``ptdp.schedule.vocab``): EF, S, T and EB read the vocabulary slices, which are
  parameters of local chunk 0 (``ptdp.parallel.vocab.stage.VocabSlices``), so they are uses of chunk 0 like
  its F/B/I/W; T (the output-weight slice) and EB (the embedding slice, last in the list) add gradients, so
  chunk 0 is reduced only after the later of them -- EB, in a training list.

* An overlapped pair (``OVERLAP``, "FB": DualPipeV, combined 1F1B) uses the chunks of both its parts: each
  part is one use, at the pair's position, so the pair is preceded by the waits of both chunks (two in a V:
  the forward's chunk and the backward's) and followed by their releases and reductions.

A new kind of compute action that reads a chunk's parameters adds itself to :data:`PARAM_USES`.
"""

from __future__ import annotations

from collections.abc import Sequence

from ptdp.schedule.actions import Action

GATHER, WAIT, RELEASE, REDUCE = "GATHER_PARAMS", "WAIT_PARAMS", "RELEASE_PARAMS", "REDUCE_GRADS"
PARAM_SYNC_OPS = frozenset({GATHER, WAIT, RELEASE, REDUCE})

# op -> whether it adds to the gradients of the chunk it names (when the list trains at all)
PARAM_USES = {"F": False, "B": True, "I": True, "W": True, "EF": False, "S": False, "T": True, "EB": True}
TRAINING_OPS = frozenset({"B", "I", "W"})  # a list with none of these is forward-only: T adds no gradient


def plan_param_sync(actions: Sequence[Action], reshard_after_forward: bool = False
                    ) -> tuple[dict[int, list[Action]], dict[int, list[Action]]]:
    """``(before, after)``: the sync actions to run before and after the use at each index of ``actions``
    (each carries the microbatch of that use, for the timeline)."""
    # (index in actions, chunk, whether it adds gradients): one per part of an overlapped pair
    uses = [(i, part.chunk, PARAM_USES[part.op]) for i, a in enumerate(actions) for part in a.parts
            if part.op in PARAM_USES]
    runs: list[tuple[int, int, int]] = []  # (chunk, first position, last position) in ``uses``
    if reshard_after_forward:
        for pos, (_, c, _) in enumerate(uses):
            if runs and runs[-1][0] == c and runs[-1][2] == pos - 1:
                runs[-1] = (c, runs[-1][1], pos)
            else:
                runs.append((c, pos, pos))
    else:
        span: dict[int, list[int]] = {}
        for pos, (_, c, _) in enumerate(uses):
            span.setdefault(c, [pos, pos])[1] = pos
        runs = sorted(((c, lo, hi) for c, (lo, hi) in span.items()), key=lambda r: r[1])
    before: dict[int, list[tuple[str, int]]] = {}
    after: dict[int, list[tuple[str, int]]] = {}
    released: dict[int, int] = {}  # chunk -> index of the action its previous run ended at
    for c, lo, hi in runs:
        issue = uses[lo - 1][0] if lo > 0 else uses[lo][0]  # prefetch one use early...
        if released.get(c, -1) >= issue:  # ...unless that is the pair whose end releases this chunk
            issue = uses[lo][0]
        released[c] = uses[hi][0]
        before.setdefault(issue, []).append((GATHER, c))
        before.setdefault(uses[lo][0], []).append((WAIT, c))
        after.setdefault(uses[hi][0], []).append((RELEASE, c))
    training = any(part.op in TRAINING_OPS for a in actions for part in a.parts)
    last_grad = {c: i for i, c, grads in uses if training and grads}
    for c, i in last_grad.items():
        after.setdefault(i, []).insert(0, (REDUCE, c))
    for ops in before.values():  # gathers waited for right here, the waits, then the prefetches
        waited = {c for op, c in ops if op == WAIT}
        ops.sort(key=lambda s: 1 if s[0] == WAIT else 0 if s[1] in waited else 2)

    def actions_at(plan: dict[int, list[tuple[str, int]]]) -> dict[int, list[Action]]:
        return {i: [Action(op, actions[i].microbatch, c) for op, c in ops] for i, ops in plan.items()}

    return actions_at(before), actions_at(after)


def add_param_sync(actions: Sequence[Action], reshard_after_forward: bool = False) -> list[Action]:
    """``actions`` with ZeRO-3's gathers, waits, releases and reductions in place (module docstring).

    They stand next to the uses they serve, so every run of consecutive SEND/RECV stays one batched call."""
    before, after = plan_param_sync(actions, reshard_after_forward)
    out: list[Action] = []
    for i, a in enumerate(actions):
        out += before.get(i, [])
        out.append(a)
        out += after.get(i, [])
    return out
