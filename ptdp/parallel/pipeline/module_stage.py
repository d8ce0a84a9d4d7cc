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

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from ptdp.models.pieces import BackwardRun, ForwardRun, fuse, interleave
from ptdp.ops.weight_grad import WeightGradStore, defer_weight_grads
from ptdp.parallel.pipeline.handlers import ActionHandler
from ptdp.parallel.pipeline.program import chunk_program
from ptdp.schedule.actions import Action, virtual_stage

# (last stage's output, the microbatch's labels, its per-token loss weights or None) -> the microbatch's loss:
# sum(weights * per-token loss), or with None the mean of the per-token losses
LossFn = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]
INPUT = "input"  # the name of a chunk's input in its pieces' run


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


@dataclass
class _Forwarded:
    """What a training forward keeps for its backward: the chunk's input (token ids, or the leaf whose
    gradient is sent back) and the backward's ``root`` (the loss, or the output); run piece by piece, also
    the pieces' ``run`` and the leaf ``output`` of its last piece that ``root`` was computed from."""

    input: Tensor
    root: Tensor
    run: ForwardRun | None = None
    output: Tensor | None = None
    name: str = ""


class ModuleStage:
    """Autograd stage: ``chunks[c]`` is this rank's model chunk c (``layout``).

    Keeps what each (chunk, microbatch) forward needs for its backward and drops it as soon as the backward
    ran, so live activations are exactly what the schedule keeps in flight. On the last virtual stage the
    output goes through ``loss_fn(output, labels, loss_weights)``, divided by the number of microbatches and
    multiplied by ``loss_scale`` (the fp16 loss scale), and the loss is the backward root. ``forward_only``
    (evaluation): no autograd graph, nothing kept, only the losses.

    ``piecewise`` (the overlapped schedules: ``ptdp.parallel.pipeline.overlap``): every training forward
    runs the chunk's pieces (``ptdp.parallel.pipeline.program``, ``ptdp.models.pieces``) and every backward drives them
    back one at a time, so that :meth:`forward_backward` can interleave one microbatch's forward with
    another's backward; the numbers are the plain run's. ``delay_weight_grads``
    (``--delay-wgrad-compute``): in an overlapped pair, a piece whose input gradients go out through an
    exchange computes its weight gradients after issuing it.

    A stage plug-in (``VocabStage``) changes what enters and leaves a chunk by overriding :meth:`_enter`,
    :meth:`_exit`, :meth:`_seed` and :meth:`_after_backward`.
    """

    def __init__(self, chunks: Sequence[nn.Module], layout: StageLayout, batches: BatchSource, loss_fn: LossFn,
                 loss_scale: float = 1.0, forward_only: bool = False, *, piecewise: bool = False,
                 delay_weight_grads: bool = False) -> None:
        if len(chunks) != layout.v:
            raise ValueError(f"ModuleStage: got {len(chunks)} model chunks for v={layout.v}")
        self.chunks, self.layout, self.batches = list(chunks), layout, batches
        self.rank, self.p, self.v, self.placement = layout.rank, layout.p, layout.v, layout.placement
        self.loss_fn, self.loss_scale, self.forward_only = loss_fn, loss_scale, forward_only
        self.piecewise, self.delay_weight_grads = piecewise and not forward_only, delay_weight_grads
        self.losses: dict[int, Tensor] = {}
        self._stash: dict[tuple[int, int], _Forwarded] = {}
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
        """Chunk ``chunk``'s forward of ``x``."""
        return self.chunks[chunk](x, **self._arguments(chunk, microbatch))

    def _arguments(self, chunk: int, microbatch: int) -> dict[str, Any]:
        """The keyword arguments of the chunk's forward (and program) besides its input: the microbatch's
        extras (a packed microbatch's document layout), and its labels (``StageLayout.labels_to_last``)."""
        extras = dict(self.batches.extras(microbatch))
        if self.layout.labels_to_last and self.is_last(chunk):
            extras["labels"] = self.batches.labels(microbatch)
        return extras

    def _loss(self, output: Tensor, microbatch: int) -> Tensor:
        b = self.batches
        loss = self.loss_fn(output, b.labels(microbatch), b.loss_weights(microbatch)) / b.num_microbatches
        return loss * self.loss_scale if self.loss_scale != 1.0 else loss

    # ---- what enters and leaves a chunk (a stage plug-in overrides these) --------------------------
    def _enter(self, chunk: int, microbatch: int, input: Tensor | None) -> Tensor:
        """The chunk's input: the microbatch's token ids on the first stage, else (training) a leaf of the
        received activation, whose gradient is sent back."""
        if self.is_first(chunk):
            return self.batches.inputs(microbatch)
        return input if self.forward_only else input.detach().requires_grad_(True)

    def _exit(self, chunk: int, microbatch: int, y: Tensor) -> tuple[Tensor, Tensor | None]:
        """(the backward's root, the activation to send) of the chunk's output: on the last stage the loss
        (recorded in ``losses``) and nothing to send."""
        if not self.is_last(chunk):
            return y, y
        loss = self._loss(y, microbatch)
        self.losses[microbatch] = loss if self.forward_only else loss.detach()
        return loss, None

    def _seed(self, chunk: int, microbatch: int, output_grad: Tensor | None, root: Tensor) -> Tensor | None:
        """The gradient the backward of ``root`` starts from: the received one (None for the loss)."""
        return output_grad

    def _after_backward(self, chunk: int, microbatch: int) -> None:
        """After the (input-gradient) backward of a chunk's microbatch."""

    # ---- the schedule's computes --------------------------------------------------------------------
    def forward(self, chunk: int, microbatch: int, input: Tensor | None) -> Tensor | None:
        x = self._enter(chunk, microbatch, input)
        if self.forward_only:
            with torch.no_grad():
                return self._exit(chunk, microbatch, self.run_chunk(chunk, microbatch, x))[1]
        if self.piecewise:
            run, name = self._pieces(chunk, microbatch, x)
            run.finish()
            return self._exit_pieces(chunk, microbatch, x, run, name)
        root, send = self._exit(chunk, microbatch, self.run_chunk(chunk, microbatch, x))
        self._stash[chunk, microbatch] = _Forwarded(x, root)
        return send

    def backward(self, chunk: int, microbatch: int, output_grad: Tensor | None) -> Tensor | None:
        dx = self._backward(chunk, microbatch, output_grad)
        self._after_backward(chunk, microbatch)
        return dx

    def backward_input(self, chunk: int, microbatch: int, output_grad: Tensor | None) -> Tensor | None:
        """The whole backward with the linears' and norms' weight grads deferred
        (``ptdp.ops.weight_grad``): the graph is freed here; W keeps only their closures.

        Every other parameter (embeddings, compiled layers) gets its grad here, as in a full B.
        """
        with defer_weight_grads(self.chunks[chunk].parameters()) as store:  # this chunk's own store
            dx = self._backward(chunk, microbatch, output_grad)
        self._weight_grad_todo[chunk, microbatch] = store
        self._after_backward(chunk, microbatch)
        return dx

    def backward_weight(self, chunk: int, microbatch: int) -> None:
        """Only the deferred wgrad GEMMs and bias/norm reductions, accumulated with autograd's hooks."""
        self._weight_grad_todo.pop((chunk, microbatch)).run()

    def forward_backward(self, forward: Action, input: Tensor | None, backward: Action, output_grad: Tensor | None,
                         saving: Callable[[], contextlib.AbstractContextManager]) -> tuple[Tensor | None, Tensor | None]:
        """``forward`` (an F) and ``backward`` (a B or I of another microbatch) at once: with ``piecewise``
        their pieces alternate (``ptdp.models.pieces.interleave``), each piece's communication in flight
        while the other's next piece computes; else one after the other. ``saving()`` is the executor's
        accounting of what the forward saves for its backward. Returns (activation to send, input gradient)."""
        fc, fmb, bc, bmb = forward.chunk, forward.microbatch, backward.chunk, backward.microbatch
        run_backward = self.backward if backward.op == "B" else self.backward_input
        if not self.piecewise:
            with saving():
                send = self.forward(fc, fmb, input)
            return send, run_backward(bc, bmb, output_grad)
        x = self._enter(fc, fmb, input)
        done = self._stash.pop((bc, bmb))
        grad = self._seed(bc, bmb, output_grad, done.root)
        split = backward.op == "I"
        with defer_weight_grads(self.chunks[bc].parameters()) if split else contextlib.nullcontext() as store:
            back = self._backward_run(bc, done, grad, self.delay_weight_grads and not split)
            run, name = self._pieces(fc, fmb, x)
            interleave(run, back, saving)
        if store is not None:
            self._weight_grad_todo[bc, bmb] = store
        dx = None if self.is_first(bc) else back.grad(INPUT)
        self._after_backward(bc, bmb)
        with saving():
            return self._exit_pieces(fc, fmb, x, run, name), dx

    # ---- piece by piece -------------------------------------------------------------------------------
    def _pieces(self, chunk: int, microbatch: int, x: Tensor) -> tuple[ForwardRun, str]:
        steps, name = chunk_program(self.chunks[chunk], INPUT, **self._arguments(chunk, microbatch))
        return ForwardRun(fuse(steps), {INPUT: x}), name

    def _exit_pieces(self, chunk: int, microbatch: int, x: Tensor, run: ForwardRun, name: str) -> Tensor | None:
        """Leave a chunk run as pieces: its output becomes a leaf, the root's graph (the loss) starts there."""
        out = run.value(name)
        leaf = out.detach().requires_grad_(out.requires_grad)
        root, send = self._exit(chunk, microbatch, leaf)
        self._stash[chunk, microbatch] = _Forwarded(x, root, run, leaf, name)
        return send

    def _backward(self, chunk: int, microbatch: int, output_grad: Tensor | None) -> Tensor | None:
        done = self._stash.pop((chunk, microbatch))
        grad = self._seed(chunk, microbatch, output_grad, done.root)
        if done.run is None:
            torch.autograd.backward(done.root, grad_tensors=grad)
            return None if self.is_first(chunk) else done.input.grad
        back = self._backward_run(chunk, done, grad, False)
        back.finish()
        return None if self.is_first(chunk) else back.grad(INPUT)

    def _backward_run(self, chunk: int, done: _Forwarded, grad: Tensor | None, delay: bool) -> BackwardRun:
        if done.root is not done.output:  # the loss: its backward gives the output's gradient
            torch.autograd.backward(done.root, grad_tensors=grad)
            grad = done.output.grad
        return BackwardRun(done.run, {done.name: grad}, self.chunks[chunk].parameters(), delay)
