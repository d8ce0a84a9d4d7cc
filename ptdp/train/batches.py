"""The microbatches of one global batch as this rank's stage reads them: the trainer's ``BatchSource``.

``Microbatches(dataset, index, batch_format, ...)`` is global batch ``index`` of ``dataset`` for this rank's
data-parallel slice (``ptdp.data.get_microbatch``: the sample order of one process), each microbatch loaded
on first use -- only the first stage reads inputs and only the last reads labels -- moved to the device
without a host wait, and under context parallelism cut to this CP rank's load-balanced chunks of the same
samples as the rest of its CP group.

Packed documents (``--reset-position-ids``, ``--reset-attention-mask``, ``--eod-mask-loss``; docs/packing.md):
each microbatch also carries its documents -- boundaries found on the host in the whole samples
(``ptdp.data.documents``), this rank's share of the restarted position ids, the attention kernel chosen at
start-up -- as a ``DocumentLayout`` every stage's chunks read with their input (``extras``), and the
per-token weights of its loss (``loss_weights``), which make the loss exact for any layout. With ``--sft``
the boundaries and the weights (assistant tokens only) come from the SFT dataset itself
(``ptdp.data.sft_dataset``), not from end-of-document tokens:

* Megatron's default: each microbatch's mean over its unmasked tokens, averaged over the microbatches and
  the data-parallel ranks. Every CP rank loaded the whole samples, so it knows the microbatch's count
  without communicating; its weights are ``c / count`` (the replicas' average divides by c again);
* ``--calculate-per-token-loss``: one mean over the unmasked tokens of the whole global batch. Its count
  is one all-reduce of this rank's counts over the data- and context-parallel group, issued in
  :meth:`Microbatches.begin`, before the schedule (the assembly's ``make_stage`` calls it on every rank);
  the weights ``c·d·m / count`` undo the step's 1/m and the replicas' average.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ptdp.data import get_microbatch, microbatch_positions
from ptdp.data.documents import DocumentOptions, cu_seqlens, loss_mask, positions
from ptdp.models.documents import DocumentLayout
from ptdp.observability import communication
from ptdp.ops.document_attention import DocumentAttention
from ptdp.parallel import ParallelState
from ptdp.parallel.collectives import group_size


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


@dataclass(frozen=True)
class BatchFormat:
    """How a global batch is cut and what each microbatch carries besides its tokens: the documents
    (None: plain windows) with the attention kernel chosen at start-up (with ``--reset-attention-mask``),
    and the loss normalisation (``--calculate-per-token-loss``)."""

    global_batch_size: int
    micro_batch_size: int
    documents: DocumentOptions | None = None
    attention: DocumentAttention | None = None
    per_token_loss: bool = False


@dataclass
class _Microbatch:
    inputs: torch.Tensor
    labels: torch.Tensor
    documents: DocumentLayout | None = None
    mask: torch.Tensor | None = None  # [b, local tokens] float: 1 where the position counts in the loss
    count: int = 0  # positions counting in the loss in the whole microbatch (every CP rank's)


def sft_microbatch(dataset, positions) -> tuple[torch.Tensor, np.ndarray, tuple[tuple[int, ...], ...]]:
    """``--sft``: (tokens ``[b, s + 1]``, loss weights ``[b, s]`` float32, each sample's ``cu_seqlens``) of the
    samples at ``positions``, from their SFT datasets (``ptdp.data.sft_dataset``)."""
    parts = [member.sft_sample(k) for member, k in (dataset.locate(i) for i in positions)]
    return (torch.from_numpy(np.stack([p[0] for p in parts])), np.stack([p[1] for p in parts]),
            tuple(p[2] for p in parts))


class Microbatches:
    """Global batch ``index`` (0-based) of ``dataset``: inputs ``[:, :-1]`` and labels ``[:, 1:]`` of each
    of this rank's ``num_microbatches`` microbatches, with their documents (module docstring)."""

    def __init__(self, dataset, index: int, batch_format: BatchFormat, state: ParallelState,
                 num_microbatches: int) -> None:
        self.dataset, self.index, self.format, self.state = dataset, index, batch_format, state
        self.num_microbatches = num_microbatches
        self._loaded: dict[int, _Microbatch] = {}
        self._global_count: torch.Tensor | None = None

    def _load(self, microbatch: int) -> _Microbatch:
        if microbatch not in self._loaded:
            fmt, state = self.format, self.state
            sft = None
            if fmt.documents is not None and fmt.documents.sft:  # tokens, weights and boundaries from the dataset
                sft = sft_microbatch(self.dataset, microbatch_positions(
                    self.index, fmt.global_batch_size, state.dp_rank, state.dims.dp, fmt.micro_batch_size,
                    microbatch))
                sample = sft[0]
            else:
                sample = get_microbatch(self.dataset, self.index, fmt.global_batch_size, state.dp_rank,
                                        state.dims.dp, fmt.micro_batch_size, microbatch)
            on_device = to_device(sample, state.device)
            batch = _Microbatch(cp_shard(on_device[:, :-1], state), cp_shard(on_device[:, 1:], state))
            if fmt.documents is not None:
                self._add_documents(batch, sample[:, :-1].numpy(), fmt.documents, sft)
            self._loaded[microbatch] = batch
        return self._loaded[microbatch]

    def _add_documents(self, batch: _Microbatch, tokens, options: DocumentOptions, sft=None) -> None:
        """The microbatch's documents, from its whole samples' inputs on the host (``tokens`` ``[b, s]``), or
        with ``--sft`` the dataset's (``sft``: :func:`sft_microbatch`)."""
        state = self.state
        bounds = sft[2] if sft is not None else tuple(cu_seqlens(row, options.eod) for row in tokens)
        ids = None
        if options.reset_position_ids:
            ids = cp_shard(to_device(torch.stack([torch.from_numpy(positions(cu)) for cu in bounds]), state.device),
                           state)
        if options.reset_position_ids or options.reset_attention_mask:
            batch.documents = DocumentLayout(bounds, ids, self.format.attention if options.reset_attention_mask
                                             else None)
        if options.masks_loss:
            mask = sft[1] if sft is not None else loss_mask(tokens, options.eod)
            batch.count = int(mask.sum())
            batch.mask = cp_shard(to_device(torch.from_numpy(mask), state.device), state)

    def inputs(self, microbatch: int) -> torch.Tensor:
        return self._load(microbatch).inputs

    def labels(self, microbatch: int) -> torch.Tensor:
        return self._load(microbatch).labels

    def extras(self, microbatch: int) -> dict[str, Any]:
        """What every chunk's forward reads besides its input: the microbatch's document layout, if any."""
        documents = self._load(microbatch).documents
        return {} if documents is None else {"documents": documents}

    def begin(self) -> None:
        """Before the schedule, on every rank: with ``--calculate-per-token-loss`` and ``--eod-mask-loss`` (or ``--sft``),
        the global batch's count of loss positions (one all-reduce over the data- and context-parallel
        ranks of this rank's counts, kept on the device: no host sync)."""
        fmt = self.format
        if not (fmt.per_token_loss and fmt.documents is not None and fmt.documents.masks_loss):
            return
        local = sum(self._load(j).mask.sum() for j in range(self.num_microbatches))
        count = local.to(torch.float64).reshape(1)
        if group_size(self.state.dp_cp_group) > 1:
            communication.all_reduce(count, group=self.state.dp_cp_group, action="loss_tokens")
        self._global_count = count.clamp(min=1.0)

    def loss_weights(self, microbatch: int) -> torch.Tensor | None:
        """Per-token weights of the microbatch's loss (before the step's 1/m), or None: its plain mean.
        See the module docstring for the two normalisations."""
        batch = self._load(microbatch)
        if batch.mask is None:
            return None
        c, d, m = self.state.dims.cp, self.state.dims.dp, self.num_microbatches
        if self._global_count is not None:  # --calculate-per-token-loss
            return batch.mask * (c * d * m / self._global_count).to(batch.mask.dtype)
        return batch.mask * (c / max(batch.count, 1))
