"""A model chunk's forward as pieces (``ptdp.models.pieces``), cut where its model declares a layer may be cut.

DualPipeV's overlapped forward-and-backward and combined 1F1B (``ptdp.parallel.pipeline.overlap``) run one
microbatch's forward interleaved with another's backward, a piece at a time, each piece's communication in
flight while the other run's piece computes. The plain model keeps none of this: it declares, with its
pipeline parts (``PipelineParts.cuts``, ``ptdp.models.parts.LayerCuts``), the residual halves of a layer in
order and in each the two linears where a parallelism that splits them communicates. :func:`chunk_program`
cuts there: the embedding, each layer's pieces (:func:`layer_pieces`), the head -- the parts the chunk holds.

A half is cut only where its linears (:class:`ptdp.models.parts.Cut`: those that read the normed input, one
entry exchange for them all, and the one that writes the block's output) offer the :class:`Seam` and communicate: tensor parallelism's
column- and row-parallel linears do (the input region ``f`` or the sequence all-gather on the way in, the
reduction ``g`` or the reduce-scatter on the way out: ``ptdp.parallel.tensor.transfers``); the plain linear does
not, so one process runs each half as one piece. A cut half is: the norm | the entry exchange | the block
with its two linears running locally (:func:`running_locally`) | the exit exchange | what follows the exit
and the residual. A block that is a program itself (a MoE layer: route, dispatch, experts, combine) brings
its own pieces between its norm and its residual.

The pieces compute what the layer's ``forward`` computes, op for op, so the overlapped schedules train as
the others do (tests/pipeline/test_dualpipe_tensor.py compares the two piece by piece).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

from torch import nn

from ptdp.models.documents import DocumentLayout
from ptdp.models.parts import Half, LayerCuts
from ptdp.models.pieces import Compute, Exchange, Step, Transfer
from ptdp.parallel.pipeline.parts import ChunkParts

LayerWrap = Callable[[str, list[Step]], list[Step]]  # (global layer key, its pieces) -> the pieces to run


@runtime_checkable
class Seam(Protocol):
    """A linear that a parallelism split, as the pieces cut it: ``forward(x)`` is
    ``after(exit(local(entry(x))))``, where ``entry`` and ``exit`` are the communication on its input and
    output (None: none)."""

    def entry(self) -> Transfer | None: ...

    def exit(self) -> Transfer | None: ...

    def local(self, x: Any) -> Any: ...

    def after(self, y: Any) -> Any: ...


# chunk -> how its layers' pieces are wrapped (full recomputation checkpoints those of the layers it
# recomputes: ``ptdp.parallel.recompute``). Kept here, not on the chunk: the model holds no pipeline state.
_LAYER_WRAPS: weakref.WeakKeyDictionary[nn.Module, LayerWrap] = weakref.WeakKeyDictionary()


def wrap_layer_pieces(chunk: nn.Module, wrap: LayerWrap) -> None:
    """Have :func:`chunk_program` pass each of ``chunk``'s layers' pieces through ``wrap(key, steps)``."""
    _LAYER_WRAPS[chunk] = wrap


def chunk_program(chunk: nn.Module, inp: str, documents: DocumentLayout | None = None,
                  labels: Any = None) -> tuple[list[Step], str]:
    """``chunk``'s forward as pieces from the value ``inp``, and the name of its output: the embedding (on
    the first stage), each layer's pieces, the head (on the last stage, given the ``labels`` that feed
    multi-token prediction)."""
    parts = ChunkParts(chunk)
    steps: list[Step] = []
    name = inp
    embedding = parts.input_embedding
    if embedding is not None:
        steps.append(Compute(lambda ids: (embedding(ids, documents),), (name,), ("embedded",), "embedding"))
        name = "embedded"
    wrap = _LAYER_WRAPS.get(chunk)
    for key, layer in parts.layers.items():
        pieces = layer_pieces(layer, parts.names.cuts, name, f"layer{key}", documents)
        steps += wrap(key, pieces) if wrap is not None else pieces
        name = f"layer{key}"
    if parts.is_last():
        head = getattr(chunk, parts.names.head)
        steps.append(Compute(lambda x: (head(x, labels),), (name,), ("logits",), "head"))
        name = "logits"
    return steps, name


def layer_pieces(layer: nn.Module, cuts: LayerCuts, inp: str, out: str,
                 documents: DocumentLayout | None = None) -> list[Step]:
    """``layer``'s forward as pieces from the value ``inp`` to ``out``: its halves in order, each cut where
    both its linears communicate (module docstring)."""
    steps: list[Step] = []
    for i, half in enumerate(cuts.halves):
        end = out if i == len(cuts.halves) - 1 else f"{out}.{half.name}"
        steps += _half(layer, half, cuts.pieces, inp, end, documents)
        inp = end
    return steps


def _half(layer: nn.Module, half: Half, own: str, inp: str, out: str, documents: DocumentLayout | None
          ) -> list[Step]:
    norm, block, residual = getattr(layer, half.norm), getattr(layer, half.block), getattr(layer, half.residual)
    args = (documents,) if half.documents else ()
    n = functools.partial("{}.{}.{}".format, out, half.name)
    program = getattr(block, own, None)
    if program is not None:  # a program itself: its pieces between the norm and the residual
        return [Compute(lambda x: (norm(x),), (inp,), (n("norm"),), f"{half.name}_norm"),
                *program(n("norm"), n("block")),
                Compute(lambda y, x: (residual(y, x),), (n("block"), inp), (out,), f"{half.name}_residual")]
    firsts, last = _cut_linears(block, half)
    entries = [f.entry() if isinstance(f, Seam) else None for f in firsts]
    entry = entries[0] if entries and all(e is not None for e in entries) else None
    exit = last.exit() if isinstance(last, Seam) else None
    if entry is None or exit is None:  # nothing to overlap: one piece
        return [Compute(lambda x: (residual(block(norm(x), *args), x),), (inp,), (out,), half.name)]

    def local(t: tuple) -> tuple:
        with running_locally(*firsts, last):
            return (block(t[0], *args),)

    return [Compute(lambda x: ((norm(x),),), (inp,), (n("norm"),), f"{half.name}_norm"),
            Exchange(lambda _: entry, n("norm"), n("in"), f"{half.name}_in"),
            Compute(lambda t: (local(t),), (n("in"),), (n("local"),), half.name),
            Exchange(lambda _: exit, n("local"), n("out"), f"{half.name}_out"),
            Compute(lambda t, x: (residual(last.after(t[0]), x),), (n("out"), inp), (out,),
                    f"{half.name}_residual")]


def _cut_linears(block: nn.Module, half: Half) -> tuple[list, Any]:
    """The linears ``block`` is cut at: those of the first of ``half.cuts`` whose last linear it has that
    read its input (an optional one absent: None), and that last one; ([], None) if none applies."""
    for cut in half.cuts:
        last = getattr(block, cut.last, None)
        if last is not None:
            return [f for f in (getattr(block, name, None) for name in cut.first) if f is not None], last
    return [], None


@contextlib.contextmanager
def running_locally(*linears: Seam) -> Iterator[None]:
    """Inside, calling one of ``linears`` runs its ``local`` part (no communication, no bias after a
    reduction): the block between its first linear's entry and its last linear's exit, computed by the
    block's own forward. Entered inside the piece, so a recomputed piece recomputes the same."""
    saved = [m.__dict__.get("forward") for m in linears]
    for m in linears:
        m.forward = m.local
    try:
        yield
    finally:
        for m, forward in zip(linears, saved, strict=True):
            if forward is None:
                del m.forward
            else:
                m.forward = forward
