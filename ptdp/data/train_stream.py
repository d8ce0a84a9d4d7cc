"""The training order across data-mix changes: what global batch ``k`` reads, and what a checkpoint records.

A run's training samples form one stream. Global batch ``k`` (from 1) reads stream positions
``[(k-1)*B, k*B)`` (``data/microbatch.py``); position ``p`` is global sample ``g = p + shift`` with
``shift = C0 - I0*B`` (``(I0, C0)``: the iteration and sample where the current ``--global-batch-size``
began, ``(0, 0)`` for a run that never changed it). The current blend began at global sample ``S``: sample
``g`` is blend position ``j = g - S`` of Megatron's greedy index over the current weights
(``blended_dataset.greedy_blend_indices``), which names a dataset ``d`` and its ``k``-th sample of the blend;
the sample read is ``start_d + k`` in ``d``'s own order, ``start_d`` being what ``d`` had consumed at ``S``.

A fresh run is ``S = 0``, every ``start_d = 0``: exactly the ``BlendedDataset`` (or ``GPTDataset``) the
builder makes, so nothing changes for a run that never changes its mix. When a resumed run's blend differs
from its checkpoint's, a new blend starts at the checkpoint's consumed samples ``C`` with the new weights and
``start_d`` = what ``d`` consumed so far (0 for a new dataset): each dataset continues with its first unread
sample, a removed one stops, and the new weights apply from the next global batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from ptdp.data.blended_dataset import BlendedDataset, blend_weights, greedy_blend_indices
from ptdp.data.errors import DataError
from ptdp.data.gpt_dataset import GPTDataset
from ptdp.data.mix_state import DataState, MemberState, dataset_identity, epoch_remaining

MID_LEVEL_SURPLUS = 0.005


class TrainStream:
    """The train split as training reads it: ``stream[p]`` is the sample at stream position ``p`` (any
    ``p >= 0`` of the current batch size's era), ``locate(p)`` its dataset and index in that dataset's order."""

    def __init__(self, members: list[MemberState], datasets: list[GPTDataset | None], blend_start: int,
                 blend_size: int, batch_start: tuple[int, int], global_batch_size: int,
                 given_weights: Sequence[float] | None = None, blend: BlendedDataset | GPTDataset | None = None,
                 indices: tuple[np.ndarray, np.ndarray] | None = None, resumed: dict | None = None) -> None:
        """``given_weights``: the active members' weights as given (the builder's floats, so an unchanged
        blend rebuilds the very same index); ``blend``: the builder's own object, reused as it is."""
        self.members, self.datasets = members, datasets
        self.blend_start, self.batch_start, self.global_batch_size = blend_start, batch_start, global_batch_size
        self.active = [i for i, d in enumerate(datasets) if d is not None and members[i].weight > 0]
        if not self.active:
            raise DataError("--data-path: no dataset with a positive weight has a training sample")
        self.seq_length = datasets[self.active[0]].seq_length
        if len(self.active) == 1:
            blend = None  # one dataset read: position j of the blend is its sample start + j
        elif not isinstance(blend, BlendedDataset):  # the greedy index over the current weights
            weights = given_weights or [members[i].weight for i in self.active]
            blend = BlendedDataset([datasets[i] for i in self.active], weights, blend_size, indices)
        self.blend = blend
        self.blend_size = len(blend) if blend is not None else blend_size
        self.resumed = resumed  # the resume summary (None: a fresh start or a checkpoint without data state)

    # -- reading ----------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.blend_size

    @property
    def shift(self) -> int:
        iteration, sample = self.batch_start
        return sample - iteration * self.global_batch_size

    def _blend_position(self, position: int) -> int:
        position = int(position)
        g = position + self.shift
        if position < 0 or position < self.batch_start[0] * self.global_batch_size or g < self.blend_start:
            first = max(self.batch_start[0], -(-(self.blend_start - self.shift) // self.global_batch_size))
            raise DataError(f"sample {position} (iteration {position // self.global_batch_size + 1}) was read "
                            f"under an earlier data mix or batch size; with this --load the stream starts at "
                            f"iteration {first + 1}")
        return g - self.blend_start

    def locate(self, position: int) -> tuple[GPTDataset, int]:
        """(dataset, index in its own order) of stream position ``position``."""
        member, k = self._locate_member(self._blend_position(position))
        return self.datasets[member], k

    def _locate_member(self, j: int) -> tuple[int, int]:
        if len(self.active) == 1:
            d = self.active[0]
            return d, self.members[d].start + j
        _, k = self.blend.locate(j)
        d = self.active[int(self.blend.dataset_index[j % len(self.blend)])]
        return d, self.members[d].start + k

    def __getitem__(self, position: int) -> np.ndarray:
        dataset, k = self.locate(position)
        return dataset[k]

    # -- accounting -------------------------------------------------------------------------------------
    def consumed_samples(self, iteration: int) -> int:
        """Global samples consumed after ``iteration`` global batches."""
        start_iteration, start_sample = self.batch_start
        return start_sample + (iteration - start_iteration) * self.global_batch_size

    def member_counts(self, n: int) -> list[int]:
        """Samples of each member read in the first ``n`` positions of the current blend."""
        counts = [0] * len(self.members)
        if n <= 0:
            return counts
        if len(self.active) == 1:
            counts[self.active[0]] = n
            return counts
        epochs, rest = divmod(n, len(self.blend))
        got = epochs * self.blend.counts + np.bincount(self.blend.dataset_index[:rest], minlength=len(self.active))
        for i, d in enumerate(self.active):
            counts[d] = int(got[i])
        return counts

    def state(self, iteration: int) -> dict:
        """The ``"data"`` entry of ``ptdp.json`` after ``iteration`` (rank 0 at a save; hashes each ``.idx`` once)."""
        consumed = self.consumed_samples(iteration)
        counts = self.member_counts(consumed - self.blend_start)
        members = []
        for member, count in zip(self.members, counts, strict=True):
            identity = member.identity() if member.removed else dataset_identity(member.prefix)
            members.append(MemberState(**{**member.to_record(), **identity, "consumed": member.start + count}))
        return DataState(consumed, iteration, self.global_batch_size, self.batch_start, self.blend_start,
                         self.blend_size, members).to_info()


def remaining_after(tokens_per_epoch: int, seq_length: int, consumed: int) -> dict:
    """Epoch and samples left in it for the summary."""
    left = epoch_remaining(consumed, tokens_per_epoch, seq_length)
    return {} if left is None else {"epoch": left[0], "remaining_in_epoch": left[1]}


def summary(state: DataState, stream: TrainStream, changed: bool, overridden: Sequence[str],
            epoch_tokens: Callable[[str], int]) -> dict:
    """The resume summary: per dataset its prefix, samples consumed so far, left in this epoch, and the
    weight before and after (``None``: not in that blend). ``epoch_tokens(prefix)``: the tokens of its train
    split, for a dataset this run does not read (weight 0)."""
    before = {m.prefix: m for m in state.members if not m.removed}
    rows = []
    for member, dataset in zip(stream.members, stream.datasets, strict=True):
        old = before.get(member.prefix)
        consumed = member.start if changed else (old.consumed if old else 0)
        row = {"prefix": member.prefix, "consumed": consumed,
               "old_weight": old.weight if old else None, "new_weight": None if member.removed else member.weight}
        if member.prefix in overridden:
            row["restarted"] = True
        if not member.removed:
            tokens = dataset.tokens_per_epoch if dataset is not None else epoch_tokens(member.prefix)
            row.update(remaining_after(tokens, stream.seq_length, consumed))
        rows.append(row)
    return {"iteration": state.iteration, "consumed_samples": state.consumed_samples, "changed": changed,
            "datasets": rows}


def summary_lines(resumed: dict) -> list[str]:
    """One line per dataset, as rank 0 prints them at resume."""
    def weight(w: float | None) -> str:
        return "none" if w is None else f"{w:.4g}"

    head = "changed: a new blend starts" if resumed["changed"] else "unchanged: the blend continues"
    lines = [f" data mix {head} at sample {resumed['consumed_samples']} (iteration {resumed['iteration']})"]
    for row in resumed["datasets"]:
        left = (f", {row['remaining_in_epoch']} left in its epoch {row['epoch']}" if "remaining_in_epoch" in row
                else "")
        note = " (started over: --override-data-state)" if row.get("restarted") else ""
        lines.append(f" data {row['prefix']}: {row['consumed']} samples consumed{left}, weight "
                     f"{weight(row['old_weight'])} -> {weight(row['new_weight'])}{note}")
    return lines


def megatron_size(weight: float, target: int) -> int:
    """Megatron's member size for ``target`` blended samples at normalized ``weight``."""
    return int(math.ceil(math.ceil(target * weight) * (1 + MID_LEVEL_SURPLUS)))


def new_blend_sizes(weights: Sequence[float], remaining: int) -> tuple[list[int], tuple[np.ndarray, np.ndarray]]:
    """Samples each member of a new blend must provide for ``remaining`` positions: Megatron's size, or the
    greedy index's actual count when that is larger (Megatron takes the weight alone and can ask a member
    past its end), and the index itself (reused, not rebuilt)."""
    index = greedy_blend_indices(blend_weights(weights), remaining)  # as BlendedDataset(..., weights) builds it
    counts = np.bincount(index[0], minlength=len(weights))
    return [max(megatron_size(w, remaining), int(c)) for w, c in zip(weights, counts, strict=True)], index
