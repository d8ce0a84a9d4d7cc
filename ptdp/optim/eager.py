"""torch's optimizers without the ``torch._dynamo`` import their first call costs.

``torch.optim.Optimizer`` wraps ``add_param_group`` (which its constructor calls) in ``torch._disable_dynamo``
and every optimizer's ``step`` in a wrapper that graph-breaks around it; both import ``torch._dynamo`` when
first called -- about 1.3-1.9 s of CPU, the largest single import of a training rank (it drags in sympy,
DTensor and the inductor's modules), paid by every worker though ptdp never steps an optimizer under
``torch.compile``. :class:`Eager` calls the functions those wrappers wrap, with what the wrappers do outside
a compiled region (``step``: gradients off unless the optimizer is differentiable); the update itself is
torch's own function, so the arithmetic is torch's to the bit. Under ``torch.compile`` it takes the wrapped
path, as torch would. BENCHMARKS.md ("Process start-up") has the numbers.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


class Eager:
    """Put before a ``torch.optim.Optimizer`` subclass in the bases: its constructor and ``step`` run without
    importing ``torch._dynamo`` (module docstring)."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if torch.compiler.is_compiling():
            return super().add_param_group(param_group)  # type: ignore[misc]
        return inspect.unwrap(torch.optim.Optimizer.add_param_group)(self, param_group)

    def step(self, closure=None):
        if torch.compiler.is_compiling():
            return super().step(closure)  # type: ignore[misc]
        step = inspect.unwrap(super().step)  # type: ignore[misc]  # the update, without the graph breaks
        previous = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])  # type: ignore[attr-defined]
            return step(self, closure)
        finally:
            torch.set_grad_enabled(previous)


class AdamW(Eager, torch.optim.AdamW):
    """``torch.optim.AdamW``, constructed and stepped without importing ``torch._dynamo``."""


class SGD(Eager, torch.optim.SGD):
    """``torch.optim.SGD``, constructed and stepped without importing ``torch._dynamo``."""
