"""Activation recomputation: keep fewer activations in the forward, recompute them in the backward.

Megatron's two granularities (Korthikanti et al., 2022; docs/references.md, §Memory):

- ``full``: a unit of whole layers keeps only its input; the backward reruns the unit's forward first.
  ``--recompute-method uniform`` cuts each model chunk into units of ``--recompute-num-layers`` layers;
  ``block`` recomputes only the first ``--recompute-num-layers`` layers of each chunk, one at a time.
- ``selective``: only the attention core (QK^T, softmax, dropout, times V -- the SDPA call) is recomputed.
  It holds the ``5·a·s²·b`` term of a layer's activations but only a few percent of its FLOPs.

ZeRO-R's activation memory work (Rajbhandari et al., 2020; docs/references.md, §ZeRO) on top of ``full``, for
the input each checkpointed unit keeps:

- ``--distribute-saved-activations`` (Megatron; ZeRO-R's *P_a*): without sequence parallelism that input is
  the same on every tensor-parallel rank, so each rank keeps only its 1/t slice and the recompute
  all-gathers it over the tensor-parallel group first (one all-gather of ``s·b·h`` per unit per backward).
- ``--checkpoint-in-cpu`` (Megatron-DeepSpeed; ZeRO-R's *P_a+cpu*, DeepSpeed's ``cpu_checkpointing``): the
  kept input (or its 1/t slice) moves to pinned host memory on a side stream and comes back for the
  recompute. A GPU feature: on the CPU the input already is in host memory (refused at start-up).

A recomputed forward must draw the same dropout masks as the first one. ``torch.utils.checkpoint``
replays the default generator; :func:`checkpoint` also replays the tensor-parallel RNG tracker's streams
(``ptdp.parallel.tensor.random``), which attention dropout and sequence-parallel dropout draw from.

:func:`apply_recompute` applies either to a plain model (or a pipeline chunk) from outside, reaching it only
through the model's declared pipeline parts (``ptdp.models.parts.PipelineParts``): ``full`` replaces its
method that runs the layers (and checkpoints the layers' pieces the overlapped schedules run,
``ptdp.parallel.pipeline.program``), ``selective`` each layer's declared attention core; the model files do
not change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ptdp.models.documents import DocumentLayout
from ptdp.models.pieces import Compute, Step
from ptdp.parallel.collectives import all_gather_single, group_rank, group_size
from ptdp.parallel.pipeline.parts import ChunkParts
from ptdp.parallel.pipeline.program import wrap_layer_pieces
from ptdp.parallel.tensor import get_rng_tracker


def recompute_environment_errors(config) -> list[str]:
    """``--checkpoint-in-cpu`` needs a GPU to move activations off (a start-up check, ``ptdp.runtime.startup``)."""
    if config.model.checkpoint_in_cpu and not torch.cuda.is_available():
        return ["--checkpoint-in-cpu needs a CUDA GPU: it moves the checkpointed layer inputs from GPU to host "
                "memory, and on the CPU they are in host memory already; drop the flag"]
    return []


def checkpoint(function: Callable[..., Tensor], *args: Any) -> Tensor:
    """``function(*args)`` keeping only ``args`` for backward; recomputed with identical RNG streams."""
    held = tuple(_HoldForRecompute.apply(a) if _is_activation(a) else a for a in args)
    return torch_checkpoint(function, *held, use_reentrant=False, preserve_rng_state=True,
                            context_fn=_replay_tracker_states)


def checkpoint_kept_elsewhere(function: Callable[[Tensor], Tensor], x: Tensor, group=None,
                              offload: bool = False) -> Tensor:
    """``function(x)`` keeping only a 1/t slice of ``x`` over ``group`` and/or a host copy of it for backward.

    Non-reentrant checkpoint saves its arguments and reruns ``function`` on them, so the argument it gets
    is what is kept (the slice, or its host copy; the executor's saved-tensor accounting sees exactly that)
    plus an empty tensor on ``x``'s device (so that the device's generator is replayed and its autocast
    state restored). The first forward runs on ``x`` itself, handed over once by a list and dropped; the
    recompute rebuilds ``x`` from what was kept: copy back, all-gather, reshape.
    """
    first = [x]
    shape, dtype, requires_grad = x.shape, x.dtype, x.requires_grad
    kept = _slice(x.detach(), group) if group_size(group) > 1 else x.detach()
    copied = None
    if offload:
        kept, copied = _to_host(kept)

    def run(kept: Tensor, anchor: Tensor) -> Tensor:
        if first:
            return function(first.pop())
        if copied is not None:
            torch.cuda.current_stream(anchor.device).wait_event(copied)
            kept = kept.to(anchor.device, non_blocking=True)
        full = kept
        if group_size(group) > 1:
            full = _gather(full, group, shape, dtype)
        return function(full.view(shape).detach().requires_grad_(requires_grad))

    return torch_checkpoint(run, kept, x.new_empty(0), use_reentrant=False, preserve_rng_state=True,
                            context_fn=_replay_tracker_states)


def _slice(x: Tensor, group) -> Tensor:
    """This rank's 1/t of ``x`` flattened (zero-padded to a multiple of t), in a storage of its own."""
    t, flat = group_size(group), x.reshape(-1)
    per = -(-flat.numel() // t)
    if per * t != flat.numel():
        flat = torch.nn.functional.pad(flat, (0, per * t - flat.numel()))
    return flat[group_rank(group) * per:(group_rank(group) + 1) * per].clone()


def _gather(part: Tensor, group, shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """The tensor :func:`_slice` cut, from every rank's slice: one all-gather over ``group``."""
    with torch.no_grad():
        out = torch.empty(part.numel() * group_size(group), dtype=dtype, device=part.device)
        all_gather_single(out, part, group=group)
    return out[:shape.numel()]


_OFFLOAD_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _to_host(t: Tensor) -> tuple[Tensor, torch.cuda.Event]:
    """A pinned host copy of device tensor ``t``, made on a side stream after the work that produced ``t``,
    and the event that marks it done.

    ``record_stream`` keeps ``t``'s memory from being reused before the copy is done; the copy back (on
    the compute stream) waits for the event first, and the host allocator keeps the pinned block until
    that copy is done.
    """
    if t.device.type != "cuda":
        raise ValueError("--checkpoint-in-cpu moves activations off a CUDA device; this tensor is on "
                         f"{t.device}")
    if t.device not in _OFFLOAD_STREAMS:
        _OFFLOAD_STREAMS[t.device] = torch.cuda.Stream(t.device)
    stream = _OFFLOAD_STREAMS[t.device]
    stream.wait_stream(torch.cuda.current_stream(t.device))
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    with torch.cuda.stream(stream):
        host.copy_(t, non_blocking=True)
    t.record_stream(stream)
    return host, stream.record_event()


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


def _maybe_checkpoint(function: Callable[..., Tensor], *args: Any) -> Tensor:
    """``function(*args)``, checkpointed when a backward will follow (no point without grad)."""
    return checkpoint(function, *args) if torch.is_grad_enabled() else function(*args)


def _run_planned(layers: list[nn.Module], plan: list[tuple[range, bool]], distribute_group, offload: bool,
                 x: Tensor, documents: DocumentLayout | None = None) -> Tensor:
    """The model's run of its layers by the plan; ``documents`` (a packed microbatch's layout) is not an activation:
    the recomputed forward reads the same object."""
    kept_elsewhere = offload or group_size(distribute_group) > 1
    for span, recompute in plan:  # full recomputation: a unit keeps only its input
        unit = functools.partial(_run, [layers[i] for i in span], documents=documents)
        if recompute and kept_elsewhere and torch.is_grad_enabled():
            x = checkpoint_kept_elsewhere(unit, x, distribute_group, offload)
        else:
            x = _maybe_checkpoint(unit, x) if recompute else unit(x)
    return x


def _run(layers: list[nn.Module], x: Tensor, documents: DocumentLayout | None = None) -> Tensor:
    for layer in layers:
        x = layer(x, documents)
    return x


def _checkpoint_steps(recomputed: frozenset[str], key: str, steps: list[Step]) -> list[Step]:
    """A recomputed layer's pieces (``ptdp.parallel.pipeline.program``), each checkpointed: the overlapped schedules run a
    layer a piece at a time, so each piece keeps only its inputs (not the whole unit's first input)."""
    if key not in recomputed:
        return steps
    return [dataclasses.replace(s, run=functools.partial(_maybe_checkpoint, s.run)) if isinstance(s, Compute)
            else s for s in steps]


def apply_recompute(model: nn.Module, granularity: str | None, method: str | None = None,
                    recompute_num_layers: int | None = None, distribute_group=None,
                    offload: bool = False) -> nn.Module:
    """``--recompute-granularity`` on a ``GPTModel`` or chunk (its layers, in order; the multi-token
    prediction modules' layers alike, each a unit of its own under ``full``); returns it.

    With ``full``, ``distribute_group`` (the tensor-parallel group, ``--distribute-saved-activations``) and
    ``offload`` (``--checkpoint-in-cpu``) say where each unit's kept input lives (module docstring)."""
    parts = ChunkParts(model)
    names, layers, mtp = parts.names, parts.layers, parts.multi_token_prediction
    modules = [] if mtp is None else list(getattr(mtp, names.mtp_modules).values())
    if granularity == "selective":
        *path, core = names.cuts.selective.split(".")  # the attention core of each layer
        for layer in [*layers.values(), *(getattr(module, names.mtp_layer) for module in modules)]:
            owner = functools.reduce(getattr, path, layer)
            setattr(owner, core, functools.partial(_maybe_checkpoint, getattr(owner, core)))
    elif granularity == "full":
        plan = recompute_plan(len(layers), granularity, method, recompute_num_layers)
        setattr(model, names.run_layers, functools.partial(_run_planned, list(layers.values()), plan,
                                                           distribute_group, offload))
        keys = list(layers)
        recomputed = frozenset(keys[i] for span, on in plan if on for i in span)
        wrap_layer_pieces(model, functools.partial(_checkpoint_steps, recomputed))
        for module in modules:
            module.forward = functools.partial(_maybe_checkpoint, module.forward)
    return model
