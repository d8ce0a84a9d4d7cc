"""Which samples a (data-parallel rank, microbatch) gets for a given iteration.

Sample positions are a pure function of the iteration: global batch ``k`` is positions
``[k*B, (k+1)*B)``, DP rank ``r`` of ``d`` takes the contiguous slice ``[k*B + r*B/d, k*B + (r+1)*B/d)``,
and microbatch ``j`` is rows ``[j*b, (j+1)*b)`` of that slice (m = B/(b*d) microbatches per pipeline, see
docs/references.md, §Notation). Consequences: any (d, b) layout sees exactly the samples of a single process
running B/b microbatches, in the same order, so parallel runs are comparable to the serial reference; and
positions are all a resume needs (which sample a position reads, across data-mix changes, is
``train_stream.TrainStream``'s business, from the data state the checkpoint records).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported lazily so `ptdp preprocess` workers start fast
    import torch


def microbatch_positions(
    iteration: int, global_batch_size: int, dp_rank: int, dp_size: int, micro_batch_size: int, microbatch: int
) -> range:
    """Dataset indices of one microbatch (validates the layout)."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
    if global_batch_size % dp_size:
        raise ValueError(
            f"global batch size {global_batch_size} is not divisible by data-parallel size {dp_size}"
        )
    per_rank = global_batch_size // dp_size
    if micro_batch_size < 1 or per_rank % micro_batch_size:
        raise ValueError(
            f"global batch size / data-parallel size = {per_rank} is not divisible by micro batch size "
            f"{micro_batch_size}"
        )
    num_micro = per_rank // micro_batch_size
    if not 0 <= microbatch < num_micro:
        raise ValueError(f"microbatch {microbatch} is not in [0, {num_micro})")
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    start = iteration * global_batch_size + dp_rank * per_rank + microbatch * micro_batch_size
    return range(start, start + micro_batch_size)


def get_microbatch(
    dataset,
    iteration: int,
    global_batch_size: int,
    dp_rank: int,
    dp_size: int,
    micro_batch_size: int,
    microbatch: int,
) -> torch.Tensor:
    """LongTensor ``[micro_batch_size, seq_length + 1]``: inputs are ``[:, :-1]``, labels ``[:, 1:]``."""
    positions = microbatch_positions(
        iteration, global_batch_size, dp_rank, dp_size, micro_batch_size, microbatch
    )
    import torch

    return torch.from_numpy(np.stack([dataset[i] for i in positions]))
