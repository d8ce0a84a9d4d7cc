"""Activation recomputation: keep fewer activations in the forward, recompute them in the backward.

Megatron's two granularities (Korthikanti et al., 2022; ptdp-facts.md, §Memory):

- ``full``: a unit of whole layers keeps only its input; the backward reruns the unit's forward first.
  ``--recompute-method uniform`` cuts each model chunk into units of ``--recompute-num-layers`` layers;
  ``block`` recomputes only the first ``--recompute-num-layers`` layers of each chunk, one at a time.
- ``selective``: only the attention core (QK^T, softmax, dropout, times V -- the SDPA call) is recomputed.
  It holds the ``5·a·s²·b`` term of a layer's activations but only a few percent of its FLOPs.

A recomputed forward must draw the same dropout masks as the first one. ``torch.utils.checkpoint``
replays the default generator; :func:`checkpoint` also replays the tensor-parallel RNG tracker's streams
(``ptdp.parallel.tensor.random``), which attention dropout and sequence-parallel dropout draw from.

:func:`apply_recompute` applies either to a plain model (or a pipeline chunk) from outside: ``full``
overrides its ``run_layers``, ``selective`` each attention's ``core``; the model files do not change.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ptdp.parallel.tensor import get_rng_tracker


def checkpoint(function: Callable[..., Tensor], *args: Tensor) -> Tensor:
    """``function(*args)`` keeping only ``args`` for backward; recomputed with identical RNG streams."""
    held = tuple(_HoldForRecompute.apply(a) if _is_activation(a) else a for a in args)
    return torch_checkpoint(function, *held, use_reentrant=False, preserve_rng_state=True,
                            context_fn=_replay_tracker_states)


def _is_activation(a: object) -> bool:
    return isinstance(a, Tensor) and a.is_floating_point() and a.requires_grad


def _replay_tracker_states() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """Called by checkpoint before the first forward: snapshot the tracker, replay it on recompute."""
    tracker = get_rng_tracker()
    snapshot = tracker.get_states()

    @contextlib.contextmanager
    def replay() -> Iterator[None]:
        current = tracker.get_states()
        tracker.set_states(snapshot)
        try:
            yield
        finally:
            tracker.set_states(current)  # the recompute must not rewind the training stream

    return contextlib.nullcontext(), replay()


class _HoldForRecompute(torch.autograd.Function):
    """Identity that saves its input for backward.

    Non-reentrant checkpoint keeps its inputs alive by reference, invisible to saved-tensor hooks; going
    through ``save_for_backward`` makes the executor's activation accounting (and any offloading hook)
    see exactly what recomputation still keeps. No copy is made.
    """

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


def recompute_plan(num_layers: int, granularity: str | None, method: str | None,
                   recompute_num_layers: int | None) -> list[tuple[range, bool]]:
    """How one model chunk runs its ``num_layers`` layers: consecutive (layers, checkpointed) units.

    >>> recompute_plan(4, "full", "uniform", 2)
    [(range(0, 2), True), (range(2, 4), True)]
    >>> recompute_plan(4, "full", "block", 1)
    [(range(0, 1), True), (range(1, 2), False), (range(2, 3), False), (range(3, 4), False)]
    """
    if granularity != "full":
        return [(range(num_layers), False)] if num_layers else []
    n = 1 if recompute_num_layers is None else recompute_num_layers
    if (method or "uniform") == "uniform":
        return [(range(i, min(i + n, num_layers)), True) for i in range(0, num_layers, n)]
    return [(range(i, i + 1), i < n) for i in range(num_layers)]


def _maybe_checkpoint(function: Callable[..., Tensor], *args: Tensor) -> Tensor:
    """``function(*args)``, checkpointed when a backward will follow (no point without grad)."""
    return checkpoint(function, *args) if torch.is_grad_enabled() else function(*args)


def _run_planned(layers: list[nn.Module], plan: list[tuple[range, bool]], x: Tensor) -> Tensor:
    for span, recompute in plan:  # full recomputation: a unit keeps only its input
        unit = functools.partial(_run, [layers[i] for i in span])
        x = _maybe_checkpoint(unit, x) if recompute else unit(x)
    return x


def _run(layers: list[nn.Module], x: Tensor) -> Tensor:
    for layer in layers:
        x = layer(x)
    return x


def apply_recompute(model: nn.Module, granularity: str | None, method: str | None = None,
                    recompute_num_layers: int | None = None) -> nn.Module:
    """``--recompute-granularity`` on a ``GPTModel`` or chunk (its layers, in order; the multi-token
    prediction modules' layers alike, each a unit of its own under ``full``); returns it."""
    mtp = [] if model.mtp is None else list(model.mtp.layers.values())
    if granularity == "selective":
        for layer in [*model.layers.values(), *(module.transformer_layer for module in mtp)]:
            layer.attention.core = functools.partial(_maybe_checkpoint, layer.attention.core)
    elif granularity == "full":
        plan = recompute_plan(len(model.layers), granularity, method, recompute_num_layers)
        model.run_layers = functools.partial(_run_planned, list(model.layers.values()), plan)
        for module in mtp:
            module.forward = functools.partial(_maybe_checkpoint, module.forward)
    return model
