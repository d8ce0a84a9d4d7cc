"""Schedules whose steady state overlaps two microbatches on one rank: DualPipeV and combined 1F1B.

* :func:`dualpipev` -- DeepSeek's DualPipeV (the "cut-in-half" DualPipe of Sea AI Lab; deepseek-ai/DualPipe;
  docs/references.md, §DualPipe): the V placement (rank r holds virtual stages r and 2p-1-r) and, in its steady
  state, the forward of one microbatch on one chunk overlapped with the full backward of another on the
  other chunk (an ``OVERLAP`` action, "FB"), with the zero-bubble split (I then W) where the pipeline
  fills and drains. The order is torch.distributed.pipelining's ``ScheduleDualPipeV`` (the same actions per
  rank in the same order; tests/pipeline/test_dualpipe_schedule.py checks it), in ptdp's actions. Needs m >= 2p.
* :func:`combined` -- Megatron-Core's ``--overlap-moe-expert-parallel-comm`` ("combined 1F1B"): the steady
  state of 1F1B or interleaved 1F1B with each (forward, backward) pair fused into one ``OVERLAP`` action.
  The last stage's pairs are one microbatch's forward and backward (not independent), so combined 1F1B
  runs one more warm-up forward on every rank: each pair is then two microbatches' (Megatron's combined
  1F1B without pipelining does the same: one extra microbatch in flight).

Why the overlap: in ``ptdp.parallel.pipeline.overlap`` the pair runs as interleaved pieces (per layer:
attention, expert dispatch, experts, combine), each piece's communication in flight while the other
microbatch's piece computes. Bubble and memory (DualPipe README, per the same number of stages PP = 2p;
F, B, W per chunk, F&B one overlapped pair): DualPipeV (PP/2-1)(F&B+B-3W) = (p-1)(F&B+B-3W), PP+1 = 2p+1
chunk activations per rank (1F1B's rank 0 holds 2p chunk units in a V).

DualPipe itself (two copies of the parameters, microbatches entering from both ends) is not here: its
stages live on two ranks depending on the microbatch's direction, which no placement of the registry
(``virtual_stage(rank, chunk)``: one rank per stage) expresses, and every parameter would need a second
copy with its gradient summed across the rank pair (docs/dualpipe.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ptdp.schedule.actions import Action, overlapped


def dualpipev(p: int, v: int, m: int, rank: int) -> list[Action]:
    """Rank ``rank``'s DualPipeV compute list (module docstring): chunk 0 holds stage ``rank``, chunk 1
    stage ``2p-1-rank``; steps as DeepSeek's reference implementation and torch's ``ScheduleDualPipeV``."""
    if m < 2 * p:
        raise ValueError(f"dualpipev needs at least 2p = {2 * p} microbatches, got m={m}")
    actions: list[Action] = []
    next_f, next_b = [0, 0], [0, 0]
    weights: deque[tuple[int, int]] = deque()  # (microbatch, chunk) whose I ran and W did not

    def forward(c: int) -> Action:
        next_f[c] += 1
        return Action("F", next_f[c] - 1, c)

    def backward(c: int, op: str = "B") -> Action:
        next_b[c] += 1
        if op == "I":
            weights.append((next_b[c] - 1, c))
        return Action(op, next_b[c] - 1, c)

    def weight() -> None:
        if weights:
            mb, c = weights.popleft()
            actions.append(Action("W", mb, c))

    def pair(f: int, b: int) -> None:
        actions.append(overlapped(forward(f), backward(b)))

    actions += [forward(0) for _ in range((p - rank - 1) * 2)]  # 1: F0 warm-up
    for _ in range(rank + 1):  # 2: F0 F1
        actions += [forward(0), forward(1)]
    for _ in range(p - rank - 1):  # 3: I1 W1 F1 (zero bubble)
        actions.append(backward(1, "I"))
        weight()
        actions.append(forward(1))
    for i in range(m - 2 * p + rank + 1):  # 4: the steady state, F0&B1 then F1&B0
        if i == 0 and rank == p - 1:  # not overlapped: the last rank's first pair would wait on itself
            actions += [forward(0), backward(1)]
        else:
            pair(0, 1)
        pair(1, 0)
    for _ in range(p - rank - 1):  # 5: B1, F1&B0
        actions.append(backward(1))
        pair(1, 0)
    split = False  # 6: B1 B0, the second half with the zero-bubble split
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        actions.append(backward(1, "I" if split else "B"))
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        actions.append(backward(0, "I" if split else "B"))
    for _ in range(p - rank - 1):  # 7: W, B0
        weight()
        actions.append(backward(0, "I" if split else "B"))
    for _ in range(rank + 1):  # 8: the remaining W
        weight()
    if weights or next_f != [m, m] or next_b != [m, m]:
        raise AssertionError(f"dualpipev p={p} m={m} rank {rank}: unbalanced list")  # a bug, not an input
    return actions


def combined(builder: Callable[..., list[Action]]) -> Callable[[int, int, int, int], list[Action]]:
    """The combined-1F1B version of a 1F1B-family builder that takes ``combined`` (module docstring)."""

    def schedule(p: int, v: int, m: int, rank: int) -> list[Action]:
        return builder(p, v, m, rank, combined=True)

    schedule.__name__ = f"combined_{builder.__name__}"
    return schedule
