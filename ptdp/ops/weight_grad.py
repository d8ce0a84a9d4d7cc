"""Deferred weight gradients: the real B/W split of zero-bubble schedules (docs/references.md, §Zero-bubble and V schedules: W must do only the weight-gradient work).

The weight-bearing ops (linears, LayerNorm/RMSNorm) are custom autograd Functions. Their backward always
computes the input gradient; the weight (and bias) gradient is computed at once, as autograd would, unless
a :func:`defer_weight_grads` context is active for the op's parameters: then the backward hands a
closure to that context's :class:`WeightGradStore` (owned by the pipeline stage running the I pass) that holds exactly what the weight gradient needs (the op's saved input and its
output gradient), and the autograd graph is freed as usual. ``WeightGradStore.run`` later computes only
those GEMMs and reductions (Megatron/ZB's ``WeightGradStore``).

The grads land where autograd would put them: ``run`` hands all of them to one ``torch.autograd.backward``
call on the parameters themselves (leaves), so ``AccumulateGrad`` accumulates into ``param.grad`` (the
flat ``main_grad`` buffer) and fires the post-accumulate hooks that ``ptdp.parallel.data.buffer`` counts --
once per parameter per microbatch, as in an ordinary backward (the empty call autograd makes in I is
recognised by :func:`grad_deferred`). Only leaf parameters are deferred; a
parameter used by a deferred op and elsewhere in the same chunk (the tied embedding when the output layer
sits with it) must not be deferred, or its hooks would fire twice per microbatch (see ``GPTModel``).

Under ``torch.compile`` (``--compile`` compiles whole layers on a GPU) the plain ops run, so compiled
layers keep the old behaviour: their weight grads are computed in the I pass and W has nothing to do
for them. Without grad (evaluation) the plain ops run too, and so they do for the parameters
:func:`compute_at_once` names: those of a stage whose schedule has no W pass (every schedule but the
zero-bubble ones, one process included), where a Python autograd Function per op would buy nothing. The
plain linear is the same GEMMs as :class:`_Linear`'s backward (torch's ``addmm``/``mm`` derivatives multiply
``grad.mm(W)`` and ``grad.t().mm(x)``, bias ``grad.sum(0)``), so losses and gradients are the same bit for bit.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

WeightGrads = list[tuple[Tensor, Tensor | None]]  # (parameter, its gradient) pairs


class WeightGradStore:
    """The deferred weight-gradient work of one backward (one chunk, one microbatch)."""

    def __init__(self) -> None:
        self._work: list[Callable[[], WeightGrads]] = []
        self.deferred: set[int] = set()  # ids of the parameters whose grads wait here

    def __len__(self) -> int:
        return len(self._work)

    def add(self, work: Callable[[], WeightGrads]) -> None:
        self._work.append(work)

    def run(self) -> None:
        """Compute every deferred weight gradient and accumulate them as autograd would (with hooks)."""
        grads: dict[int, tuple[Tensor, Tensor]] = {}
        work, self._work = self._work, []
        for fn in work:
            for param, grad in fn():
                if grad is None:
                    continue
                seen = grads.get(id(param))
                grads[id(param)] = (param, grad if seen is None else seen[1] + grad)
        if grads:
            params, values = zip(*grads.values())
            torch.autograd.backward(list(params), list(values))


_STORE_ATTR = "_ptdp_weight_grad_store"  # set on a parameter while its owner's I pass defers its grads


@contextlib.contextmanager
def defer_weight_grads(params: Iterable[Tensor]) -> Iterator[WeightGradStore]:
    """While active, the deferrable weight grads of ``params`` go to the yielded store, not ``param.grad``.

    The store belongs to its caller (a pipeline stage's chunk, ``ModuleStage``): the ops find it through
    their own parameters, so there is no module-global state; two stages (or threads: a CUDA backward runs
    on autograd's engine threads) deferring at once each get their own parameters' grads.
    """
    store, params = WeightGradStore(), [p for p in params if p is not None]
    previous = [getattr(p, _STORE_ATTR, None) for p in params]
    for p in params:
        setattr(p, _STORE_ATTR, store)
    try:
        yield store
    finally:
        for p, before in zip(params, previous):
            setattr(p, _STORE_ATTR, before)


def _store_of(param: Tensor | None) -> WeightGradStore | None:
    return None if param is None else getattr(param, _STORE_ATTR, None)


def deferring_store(*params: Tensor | None) -> WeightGradStore | None:
    """The store deferring ``params`` (those given) if they are all leaves of one deferring owner, else
    None: compute now.

    The returned store marks them deferred (see :func:`grad_deferred`).
    """
    given = [p for p in params if p is not None]
    stores = {id(_store_of(p)): _store_of(p) for p in given}
    store = next(iter(stores.values()), None)
    if store is None or len(stores) != 1 or any(not p.is_leaf for p in given):
        return None
    store.deferred.update(id(p) for p in given)
    return store


def grad_deferred(param: Tensor) -> bool:
    """Whether ``param``'s grad of the running backward waits in its owner's store.

    Autograd still runs a deferred parameter's ``AccumulateGrad`` in the I pass (with no gradient) and
    fires its post-accumulate hooks: hooks that count or copy gradients must ignore that call (the
    gradient buffers do); the real one comes from :meth:`WeightGradStore.run`.
    """
    store = _store_of(param)
    return store is not None and id(param) in store.deferred


def plain_path() -> bool:
    """No autograd Function needed: no grad mode, or traced by torch.compile (see the module docstring)."""
    return not torch.is_grad_enabled() or torch.compiler.is_compiling()


# id -> weak reference of the parameters whose weight grads no W pass will ask for (by identity: a WeakSet
# would compare tensors with ==); an entry leaves with its parameter, before its id can be reused
_AT_ONCE: dict[int, weakref.ref] = {}


def compute_at_once(params: Iterable[Tensor]) -> None:
    """``params``' weight grads are never deferred (their stage's schedule has no W pass): the linears and
    LayerNorms holding them run torch's own ops, the same kernels bit for bit (module docstring). Set once
    at set-up, by whoever knows the schedule (``ptdp.parallel.assembly``)."""
    for p in params:
        if p is not None and id(p) not in _AT_ONCE:
            _AT_ONCE[id(p)] = weakref.ref(p, _forget(id(p)))


def _forget(key: int) -> Callable[[weakref.ref], None]:
    return lambda _: _AT_ONCE.pop(key, None)


def at_once(weight: Tensor) -> bool:
    """Whether an op of ``weight`` may run torch's plain op: :func:`plain_path`, or :func:`compute_at_once`
    (asked second: torch.compile decides on ``is_compiling`` before it would trace an ``id()``)."""
    return plain_path() or id(weight) in _AT_ONCE


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight.flatten(0, -2), bias.flatten())`` whose weight and bias grads can be deferred.

    ``weight`` is the parameter itself (a fused ``[k, n, h]`` weight is flattened inside), so a deferred
    grad has a leaf to land on. The bias stays inside the GEMM (addmm) either way.
    """
    if at_once(weight):
        return F.linear(x, weight.flatten(0, -2), None if bias is None else bias.flatten())
    return _Linear.apply(x, weight, bias)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.params = (weight, bias)  # the leaves the deferred grads land on (not saved tensors: no copy)
        return F.linear(x, weight.flatten(0, -2), None if bias is None else bias.flatten())

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        w_param, b_param = ctx.params
        dx = grad.matmul(weight.flatten(0, -2)) if ctx.needs_input_grad[0] else None
        need_w = ctx.needs_input_grad[1]
        need_b = b_param is not None and ctx.needs_input_grad[2]

        def weight_grads() -> WeightGrads:
            g2 = grad.reshape(-1, grad.shape[-1])
            dw = g2.t().mm(x.reshape(-1, x.shape[-1])).view(w_param.shape) if need_w else None
            db = g2.sum(0).view(b_param.shape) if need_b else None
            return [(w_param, dw), (b_param, db)]

        if not (need_w or need_b):
            return dx, None, None
        store = deferring_store(w_param, b_param)
        if store is None:
            (_, dw), (_, db) = weight_grads()
            return dx, dw, db
        store.add(weight_grads)
        return dx, None, None


def add_bias(y: Tensor, bias: Tensor | None) -> Tensor:
    """``y + bias`` whose bias grad (the sum over tokens) can be deferred (row-parallel bias after g)."""
    if bias is None:
        return y
    if plain_path():
        return y + bias
    return _AddBias.apply(y, bias)


class _AddBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: Tensor, bias: Tensor) -> Tensor:
        ctx.bias = bias
        return y + bias

    @staticmethod
    def backward(ctx, grad: Tensor):
        bias = ctx.bias
        if not ctx.needs_input_grad[1]:
            return grad, None

        def weight_grads() -> WeightGrads:
            return [(bias, grad.reshape(-1, grad.shape[-1]).sum(0).view(bias.shape))]

        store = deferring_store(bias)
        if store is None:
            return grad, weight_grads()[0][1]
        store.add(weight_grads)
        return grad, None
