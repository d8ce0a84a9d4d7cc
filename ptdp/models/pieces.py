"""A model's forward as pieces with explicit boundaries, so that two microbatches can run interleaved.

DualPipe's overlapped forward-and-backward (docs/references.md, §DualPipe) runs one microbatch's forward and
another's backward at once, piece by piece (per layer: attention, expert dispatch, experts, combine), each
piece's communication in flight while the other microbatch's piece computes. That needs what one autograd
graph does not give: a forward that stops between pieces, and a backward driven one piece at a time, with
the communication between pieces issued asynchronously and waited on only when its result is needed.

A *program* is a list of steps over named values:

* :class:`Compute` -- ``run(*inputs) -> outputs``, ordinary autograd code (a layer's attention half, a MoE
  layer's router, its experts, ...). Its inputs enter as fresh leaves (detached tensors that require grad
  where the value did), so its backward is one ``torch.autograd.backward`` over its outputs, which yields the
  gradients of its inputs; nothing of the graph crosses a boundary.
* :class:`Exchange` -- communication OUTSIDE autograd between two computes: ``make(values)`` builds a
  :class:`Transfer` from what the earlier steps produced (the split sizes of an all-to-all), whose ``start``
  issues the forward communication of a tuple of tensors and ``start_backward`` its transpose, each returning
  a :class:`Pending` waited on by the step that consumes it (``ptdp.parallel.expert.dispatch`` provides the
  expert dispatch's, ``ptdp.parallel.tensor.transfers`` a layer's tensor-parallel collectives: gloo work
  handles on the CPU, NCCL's own stream on a GPU).

:func:`run_sequential` runs a program at once with autograd through the exchanges (a MoE layer's plain
``forward`` is exactly that), :class:`ForwardRun` / :class:`BackwardRun` one step at a time, and
:func:`interleave` alternates a forward and a backward run; :func:`fuse` first makes each stretch between
two exchanges one piece, so that what overlaps an exchange is a whole piece of the other run. The pieces compute what the layer's ``forward``
computes, op for op, and the backward sums a value's gradients from its consumers as autograd does, so the
numbers are those of the sequential run. The module knows no parallelism: it only calls what it is given.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from ptdp.ops.weight_grad import defer_weight_grads

Values = dict[str, Any]


class Pending(Protocol):
    """Communication in flight; ``wait`` returns its result (a tuple of tensors, None where none)."""

    def wait(self) -> tuple: ...


class Transfer(Protocol):
    """One exchange between pieces: the forward communication and its transpose (for the gradients)."""

    def start(self, tensors: tuple) -> Pending: ...

    def start_backward(self, grads: tuple) -> Pending: ...


@dataclass(frozen=True)
class Done:
    """A :class:`Pending` that is already complete (a group of one, a local exchange)."""

    result: tuple

    def wait(self) -> tuple:
        return self.result


@dataclass(frozen=True)
class Compute:
    """An autograd piece: ``run(*values of inputs)`` returns the values of ``outputs`` (a tuple)."""

    run: Callable[..., tuple]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    name: str = "compute"


@dataclass(frozen=True)
class Exchange:
    """Communication of the value ``input`` (a tuple of tensors) into ``output``, outside autograd."""

    make: Callable[[Values], Transfer]
    input: str
    output: str
    name: str = "exchange"


Step = Compute | Exchange


def fuse(steps: Sequence[Step]) -> list[Step]:
    """``steps`` with every run of consecutive compute steps made one: between two exchanges there is one
    piece, so each exchange in flight overlaps a whole piece of the other run (the experts, or the combine's
    end with the next layer's attention and router), not a sliver of it; and fewer pieces, fewer autograd
    calls. The fused piece's outputs are all its steps' (a later step may read any of them)."""
    out: list[Step] = []
    run: list[Compute] = []

    def flush() -> None:
        if len(run) > 1:
            out.append(_fused(tuple(run)))
        elif run:
            out.append(run[0])
        run.clear()

    for step in steps:
        if isinstance(step, Compute):
            run.append(step)
        else:
            flush()
            out.append(step)
    flush()
    return out


def _fused(run: tuple[Compute, ...]) -> Compute:
    inputs: list[str] = []
    produced: set[str] = set()
    for step in run:
        inputs += [n for n in step.inputs if n not in produced and n not in inputs]
        produced.update(step.outputs)
    outputs = tuple(n for step in run for n in step.outputs)

    def fused(*args: Any) -> tuple:
        values = dict(zip(inputs, args, strict=True))
        for step in run:
            values.update(zip(step.outputs, step.run(*(values[n] for n in step.inputs)), strict=True))
        return tuple(values[n] for n in outputs)

    return Compute(fused, tuple(inputs), outputs, "+".join(step.name for step in run))


def _leaf(value: Any) -> Any:
    """A boundary: tensors that carry gradients become fresh leaves; tuples elementwise; the rest as is."""
    if isinstance(value, Tensor):
        return value.detach().requires_grad_(True) if value.requires_grad else value
    if isinstance(value, tuple):
        return tuple(_leaf(v) for v in value)
    return value


def _grad(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.grad if value.requires_grad else None
    if isinstance(value, tuple):
        return tuple(_grad(v) for v in value)
    return None


def _add(a: Any, b: Any) -> Any:
    """Gradients of one value from two consumers, summed (None: no gradient)."""
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, tuple):
        return tuple(_add(x, y) for x, y in zip(a, b, strict=True))
    return a + b


def _pairs(value: Any, grad: Any) -> list[tuple[Tensor, Tensor | None]]:
    """(tensor, its gradient) for each tensor of ``value`` that takes part in the backward."""
    if isinstance(value, tuple):
        grads = grad if isinstance(grad, tuple) else (None,) * len(value)
        return [pair for v, g in zip(value, grads, strict=True) for pair in _pairs(v, g)]
    if isinstance(value, Tensor) and value.requires_grad and (grad is not None or value.numel() == 1):
        return [(value, grad)]
    return []


def _needs_grad(value: Any) -> tuple[bool, ...]:
    return tuple(isinstance(v, Tensor) and v.requires_grad for v in value)


def _mark(result: tuple, needs: tuple[bool, ...]) -> tuple:
    """An exchange's result carries gradients where its input did."""
    return tuple(t.requires_grad_(True) if need and isinstance(t, Tensor) else t for t, need in zip(result, needs))


class _Exchanged(torch.autograd.Function):
    """An exchange inside autograd (:func:`run_sequential`): forward ``start().wait()``, backward the
    transpose."""

    @staticmethod
    def forward(ctx, transfer: Transfer, *tensors: Tensor):
        ctx.transfer, ctx.needs = transfer, _needs_grad(tensors)
        out = transfer.start(tensors).wait()
        ctx.mark_non_differentiable(*[t for t, need in zip(out, ctx.needs) if not need and isinstance(t, Tensor)])
        return out

    @staticmethod
    def backward(ctx, *grads: Tensor):
        back = ctx.transfer.start_backward(tuple(g if n else None for g, n in zip(grads, ctx.needs))).wait()
        return (None, *back)


def exchanged(transfer: Transfer, tensors: tuple) -> tuple:
    """``tensors`` through ``transfer`` inside autograd (the backward runs its transpose)."""
    return _Exchanged.apply(transfer, *tensors)


def run_sequential(steps: Sequence[Step], values: Values) -> Values:
    """The program at once, autograd through every step (exchanges waited on at once): a layer's plain
    forward."""
    values = dict(values)
    for step in steps:
        if isinstance(step, Compute):
            values.update(zip(step.outputs, step.run(*(values[n] for n in step.inputs)), strict=True))
        else:
            values[step.output] = exchanged(step.make(values), values[step.input])
    return values


@dataclass
class _Record:
    """What one compute step of a forward run keeps for its backward."""

    step: Compute
    leaves: tuple
    outputs: tuple


class ForwardRun:
    """One microbatch's forward through ``steps``, a compute step at a time (module docstring)."""

    def __init__(self, steps: Sequence[Step], values: Values) -> None:
        self.steps, self.values = list(steps), dict(values)
        self.index = 0
        self.records: list[_Record | tuple[Exchange, Transfer, tuple[bool, ...]]] = []
        self._pending: dict[str, tuple[Pending, tuple[bool, ...]]] = {}
        self._start_exchanges()

    @property
    def done(self) -> bool:
        return self.index >= len(self.steps)

    def value(self, name: str) -> Any:
        """A value of the run, waiting for the exchange that produces it."""
        if name in self._pending:
            pending, needs = self._pending.pop(name)
            self.values[name] = _mark(pending.wait(), needs)
        return self.values[name]

    def step(self, context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
        """Run the next compute step (inside ``context``: the executor's saved-activation accounting), then
        issue the exchanges that follow it."""
        step = self.steps[self.index]
        leaves = tuple(_leaf(self.value(n)) for n in step.inputs)
        with context():
            outputs = tuple(step.run(*leaves))
        self.records.append(_Record(step, leaves, outputs))
        self.values.update(zip(step.outputs, outputs, strict=True))
        self.index += 1
        self._start_exchanges()

    def finish(self, context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> Values:
        while not self.done:
            self.step(context)
        return self.values

    def _start_exchanges(self) -> None:
        while not self.done and isinstance(self.steps[self.index], Exchange):
            ex = self.steps[self.index]
            tensors = self.value(ex.input)
            transfer, needs = ex.make(self.values), _needs_grad(tensors)
            self._pending[ex.output] = (transfer.start(tuple(t.detach() if isinstance(t, Tensor) else t
                                                             for t in tensors)), needs)
            self.records.append((ex, transfer, needs))
            self.index += 1


class BackwardRun:
    """The backward of a finished :class:`ForwardRun`, a compute step at a time, from ``grads`` (the
    gradients of its outputs, None for a scalar loss). ``delay_weight_grads`` (Megatron-Core's
    ``--delay-wgrad-compute``): a step whose input gradients go out through an exchange computes its
    weight gradients (of ``weights``) after issuing that exchange, as more work to hide it behind."""

    def __init__(self, forward: ForwardRun, grads: Values, weights: Iterable[Tensor] = (),
                 delay_weight_grads: bool = False) -> None:
        self.records = forward.records  # taken over: each piece's tensors go as soon as its backward ran
        self._received = {r[0].output: forward.values[r[0].output] for r in self.records if isinstance(r, tuple)}
        forward.records, forward.values = [], {}
        self.grads: Values = dict(grads)
        self._pending: dict[str, Pending] = {}
        self.weights, self.delay = list(weights), delay_weight_grads
        self._start_exchanges()

    @property
    def done(self) -> bool:
        return not self.records

    def grad(self, name: str) -> Any:
        """The gradient of a value of the forward run, waiting for the exchange that brings it."""
        if name in self._pending:
            self.grads[name] = _add(self.grads.get(name), self._pending.pop(name).wait())
        return self.grads.get(name)

    def step(self) -> None:
        """The backward of the last compute step not yet run, then the exchanges that carry its input
        gradients back (issued before any delayed weight gradient)."""
        record = self.records.pop()
        pairs = [pair for name, out in zip(record.step.outputs, record.outputs)
                 for pair in _pairs(out, self.grad(name))]
        delay = self.delay and self.records and not isinstance(self.records[-1], _Record)
        store = None
        if pairs:
            tensors, grads = zip(*pairs)
            with defer_weight_grads(self.weights) if delay else contextlib.nullcontext() as store:
                torch.autograd.backward(list(tensors), list(grads))
        for name, leaf in zip(record.step.inputs, record.leaves):
            g = _grad(leaf)
            if g is not None and any(x is not None for x in (g if isinstance(g, tuple) else (g,))):
                self.grads[name] = _add(self.grads.get(name), g)
        self._start_exchanges()
        if store is not None:
            store.run()

    def finish(self) -> Values:
        while not self.done:
            self.step()
        return self.grads

    def _start_exchanges(self) -> None:
        while self.records and not isinstance(self.records[-1], _Record):
            ex, transfer, needs = self.records.pop()
            grad = self.grad(ex.output) or (None,) * len(needs)
            received = self._received.pop(ex.output)  # a gradient nobody produced is zero: the peers wait for it
            grads = tuple((torch.zeros_like(r) if g is None else g) if need else None
                          for g, r, need in zip(grad, received, needs))
            self._pending[ex.input] = transfer.start_backward(grads)


def interleave(forward: ForwardRun, backward: BackwardRun,
               context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
    """Alternate one compute step of ``forward`` and one of ``backward`` until both are done: each step's
    communication is in flight while the other run's next step computes (module docstring)."""
    while not (forward.done and backward.done):
        if not forward.done:
            forward.step(context)
        if not backward.done:
            backward.step()
