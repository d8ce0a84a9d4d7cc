"""The microbatches of one global batch as this rank's stage reads them: the trainer's ``BatchSource``.

``Microbatches(dataset, index, ...)`` is global batch ``index`` of ``dataset`` for this rank's
data-parallel slice (``ptdp.data.get_microbatch``: the sample order of one process), each microbatch loaded
on first use -- only the first stage reads inputs and only the last reads labels -- moved to the device
without a host wait, and under context parallelism cut to this CP rank's load-balanced chunks of the same
samples as the rest of its CP group.
"""

from __future__ import annotations

import torch

from ptdp.config import TrainingConfig
from ptdp.data import get_microbatch
from ptdp.parallel import ParallelState


def cp_shard(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """This CP rank's load-balanced chunks of ``[b, s]`` (itself when c = 1)."""
    if state.dims.cp == 1:
        return x
    from ptdp.parallel.context.attention import shard_sequence

    return shard_sequence(x, state.dims.cp, state.cp_rank, dim=1)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without the host waiting: to a GPU through pinned memory with
    ``non_blocking=True`` (a pageable copy is a cudaStreamSynchronize); on the CPU, itself."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class Microbatches:
    """Global batch ``index`` (0-based) of ``dataset``: inputs ``[:, :-1]`` and labels ``[:, 1:]`` of each
    of this rank's ``num_microbatches`` microbatches (module docstring)."""

    def __init__(self, dataset, index: int, training: TrainingConfig, state: ParallelState,
                 num_microbatches: int) -> None:
        self.dataset, self.index, self.training, self.state = dataset, index, training, state
        self.num_microbatches = num_microbatches
        self._loaded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _load(self, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        if microbatch not in self._loaded:
            tr, state = self.training, self.state
            sample = get_microbatch(self.dataset, self.index, tr.global_batch_size, state.dp_rank, state.dims.dp,
                                    tr.micro_batch_size, microbatch)
            sample = to_device(sample, state.device)
            self._loaded[microbatch] = cp_shard(sample[:, :-1], state), cp_shard(sample[:, 1:], state)
        return self._loaded[microbatch]

    def inputs(self, microbatch: int) -> torch.Tensor:
        return self._load(microbatch)[0]

    def labels(self, microbatch: int) -> torch.Tensor:
        return self._load(microbatch)[1]
