"""The autograd pipeline stage: one ``nn.Module`` per local model chunk, fed by a batch source.

``ModuleStage`` is what every training and evaluation step runs (``forward_only`` for evaluation); a
parallelism that computes more on a stage wraps it (vocabulary parallelism: ``VocabStage``) and registers
handlers for its own actions (``handlers()``). Microbatches come from a :class:`BatchSource` (the trainer's
is ``ptdp.train.batches.Microbatches``), not from closures: every stage reads from its own source what its
chunks need of a microbatch -- the first stage its tokens, the last its labels and loss weights, every stage
the keyword arguments of its chunks' forward (``extras``: a packed microbatch's document layout) -- so
nothing but activations and their gradients travels between stages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from ptdp.ops.weight_grad import WeightGradStore, defer_weight_grads
from ptdp.parallel.pipeline.handlers import ActionHandler
from ptdp.schedule.actions import virtual_stage

# (last stage's output, the microbatch's labels, its per-token loss weights or None) -> the microbatch's loss:
# sum(weights * per-token loss), or with None the mean of the per-token losses
LossFn = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]


class BatchSource(Protocol):
    """One global batch's microbatches for this rank: the first stage reads ``inputs``, the last ``labels``
    and ``loss_weights``, every stage ``extras``."""

    num_microbatches: int

    def inputs(self, microbatch: int) -> Tensor: ...

    def labels(self, microbatch: int) -> Tensor: ...

    def extras(self, microbatch: int) -> Mapping[str, Any]:
        """Keyword arguments of every chunk's forward for this microbatch besides its input ({}: none)."""
        ...

    def loss_weights(self, microbatch: int) -> Tensor | None:
        """Per-token weights of the microbatch's loss, or None: the mean over its tokens."""
        ...

    def begin(self) -> None:
        """Called on every rank before the schedule runs on this batch (a source's collectives go here)."""
        ...


class PlainBatches:
    """The defaults of a :class:`BatchSource` whose microbatches are plain windows: no extras, mean loss."""

    def extras(self, microbatch: int) -> Mapping[str, Any]:
        return {}

    def loss_weights(self, microbatch: int) -> Tensor | None:
        return None

    def begin(self) -> None:
        return None


@dataclass(frozen=True)
class StageLayout:
    """Which virtual stages this rank's ``v`` chunks hold (``virtual_stage`` under the schedule's placement);
    ``labels_to_last``: the last virtual stage's chunk also reads the microbatch's labels (a model that
    computes a loss of its own from them: multi-token prediction, ``ptdp.models.mtp``)."""

    rank: int
    p: int
    v: int
    placement: str = "loop"
    labels_to_last: bool = False

    def virtual_stage(self, chunk: int) -> int:
        return virtual_stage(self.rank, chunk, self.p, self.placement)

    def is_first(self, chunk: int) -> bool:
        return self.virtual_stage(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.virtual_stage(chunk) == self.p * self.v - 1


class ModuleStage:
    """Autograd stage: ``chunks[c]`` is this rank's model chunk c (``layout``).

    Keeps (input, output) per (chunk, microbatch) between forward and backward and drops them as soon as
    the backward ran, so live activations are exactly what the schedule keeps in flight. On the last
    virtual stage the output goes through ``loss_fn(output, labels, loss_weights)``, divided by the number of
    microbatches and multiplied by ``loss_scale`` (the fp16 loss scale), and the loss is the backward root.
    ``forward_only`` (evaluation): no autograd graph, nothing kept, only the losses.
    """

    def __init__(self, chunks: Sequence[nn.Module], layout: StageLayout, batches: BatchSource, loss_fn: LossFn,
                 loss_scale: float = 1.0, forward_only: bool = False) -> None:
        if len(chunks) != layout.v:
            raise ValueError(f"ModuleStage: got {len(chunks)} model chunks for v={layout.v}")
        self.chunks, self.layout, self.batches = list(chunks), layout, batches
        self.rank, self.p, self.v, self.placement = layout.rank, layout.p, layout.v, layout.placement
        self.loss_fn, self.loss_scale, self.forward_only = loss_fn, loss_scale, forward_only
        self.losses: dict[int, Tensor] = {}
        self._stash: dict[tuple[int, int], tuple[Any, Tensor]] = {}
        self._weight_grad_todo: dict[tuple[int, int], WeightGradStore] = {}

    def is_first(self, chunk: int) -> bool:
        return self.layout.is_first(chunk)

    def is_last(self, chunk: int) -> bool:
        return self.layout.is_last(chunk)

    def parameters(self) -> list[nn.Parameter]:
        return [q for c in self.chunks for q in c.parameters()]

    def handlers(self) -> Mapping[str, ActionHandler]:
        """The actions this stage runs beyond F/B/I/W: none (a wrapping plug-in adds its own)."""
        return {}

    def run_chunk(self, chunk: int, microbatch: int, x: Tensor) -> Tensor:
        """Chunk ``chunk``'s forward of ``x`` (with the microbatch's labels: ``StageLayout.labels_to_last``)."""
        extras = self.batches.extras(microbatch)  # a packed microbatch's document layout
        if self.layout.labels_to_last and self.is_last(chunk):
            return self.chunks[chunk](x, labels=self.batches.labels(microbatch), **extras)
        return self.chunks[chunk](x, **extras)

    def _loss(self, output: Tensor, microbatch: int) -> Tensor:
        b = self.batches
        loss = self.loss_fn(output, b.labels(microbatch), b.loss_weights(microbatch)) / b.num_microbatches
        return loss * self.loss_scale if self.loss_scale != 1.0 else loss

    def forward(self, chunk: int, microbatch: int, input: Tensor | None) -> Tensor | None:
        if self.forward_only:
            x = self.batches.inputs(microbatch) if self.is_first(chunk) else input
            with torch.no_grad():
                y = self.run_chunk(chunk, microbatch, x)
                if self.is_last(chunk):
                    self.losses[microbatch] = self._loss(y, microbatch)
                    return None
            return y
        if self.is_first(chunk):
            x = self.batches.inputs(microbatch)
        else:
            x = input.detach().requires_grad_(True)  # a leaf: its .grad is what we send back
        y = self.run_chunk(chunk, microbatch, x)
        if self.is_last(chunk):
            y = self._loss(y, microbatch)
            self.losses[microbatch] = y.detach()
            self._stash[chunk, microbatch] = (x, y)
            return None
        self._stash[chunk, microbatch] = (x, y)
        return y

    def backward(self, chunk: int, microbatch: int, output_grad: Tensor | None) -> Tensor | None:
        x, y = self._stash.pop((chunk, microbatch))
        torch.autograd.backward(y, grad_tensors=output_grad)
        return None if self.is_first(chunk) else x.grad

    def backward_input(self, chunk: int, microbatch: int, output_grad: Tensor | None) -> Tensor | None:
        """The whole backward with the linears' and norms' weight grads deferred
        (``ptdp.ops.weight_grad``): the graph is freed here; W keeps only their closures.

        Every other parameter (embeddings, compiled layers) gets its grad here, as in a full B.
        """
        x, y = self._stash.pop((chunk, microbatch))
        with defer_weight_grads(self.chunks[chunk].parameters()) as store:  # this chunk's own store
            torch.autograd.backward(y, grad_tensors=output_grad)
        self._weight_grad_todo[chunk, microbatch] = store
        return None if self.is_first(chunk) else x.grad

    def backward_weight(self, chunk: int, microbatch: int) -> None:
        """Only the deferred wgrad GEMMs and bias/norm reductions, accumulated with autograd's hooks."""
        self._weight_grad_todo.pop((chunk, microbatch)).run()
