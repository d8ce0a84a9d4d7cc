"""Fused element-wise operations: bias + GeLU and bias + dropout + residual add, compiled on request.

Megatron fuses these chains of memory-bound element-wise ops into one kernel each (``bias_gelu_fusion``,
``bias_dropout_fusion``) so an activation is read and written once instead of three times. Here the fusion
is done by ``torch.compile`` when ``--compile`` is given; otherwise the same Python functions run eagerly,
so the default path starts instantly. Inductor is told to draw random numbers exactly as eager PyTorch does
(``fallback_random``), so a compiled run draws the same dropout masks and gives the same numbers.

If compilation is unavailable or fails (no C++ compiler, unsupported platform) the eager functions are
used after a one-line warning: ``--compile`` is an optimisation, never a reason for a run to stop.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def outside_compile(fn: Callable) -> Callable:
    """``torch.compiler.disable(fn)``, applied when first called under ``torch.compile``.

    The decorator itself imports ``torch._dynamo`` (about 1.4 s of CPU), which every process importing the
    models would pay at import time though only ``--compile`` on a GPU traces them. Traced, the wrapper
    calls the disabled function: the compiled graph breaks there and ``fn`` runs eagerly, as with the
    decorator; untraced, it calls ``fn``."""
    disabled: list[Callable] = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            if not disabled:
                disabled.append(torch.compiler.disable(fn))
            return disabled[0](*args, **kwargs)
        return fn(*args, **kwargs)

    return call


def bias_gelu(y: torch.Tensor, bias: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GeLU(y + bias): the tanh approximation (GPT-2's, Megatron's fused kernel's) or, ``approximate="none"``,
    the exact erf form (``ModelConfig.gelu_approximate``)."""
    return F.gelu(y + bias, approximate=approximate)


def bias_dropout_add(y: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float,
                     training: bool) -> torch.Tensor:
    """residual + dropout(y + bias): the end of each half of a transformer layer."""
    if bias is not None:
        y = y + bias
    return residual + F.dropout(y, p, training)


@dataclass(frozen=True)
class FusedOps:
    bias_gelu: Callable[..., torch.Tensor]
    bias_dropout_add: Callable[..., torch.Tensor]
    compiled: bool


EAGER = FusedOps(bias_gelu, bias_dropout_add, compiled=False)
_compiled_ops: FusedOps | None = None


def fused_ops(compile: bool) -> FusedOps:
    """The eager functions, or (``compile``) their torch.compile'd versions, built once per process."""
    global _compiled_ops
    if not compile:
        return EAGER
    if _compiled_ops is None:
        _compiled_ops = _compile_or_eager()
    return _compiled_ops


def _compile_or_eager() -> FusedOps:
    try:
        import torch._inductor.config as inductor_config

        inductor_config.fallback_random = True  # same RNG calls as eager: identical dropout masks
        ops = FusedOps(torch.compile(bias_gelu, dynamic=True), torch.compile(bias_dropout_add, dynamic=True),
                       compiled=True)
        _probe(ops)
        return ops
    except Exception as e:  # any compiler failure (missing toolchain, unsupported op) means: run eagerly
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        warnings.warn(f"--compile: torch.compile failed ({reason}); using the eager fused ops", stacklevel=3)
        return EAGER


def _probe(ops: FusedOps) -> None:
    """Compile forward and backward now (they compile lazily), so failures surface here, not mid-step.

    Runs under ``fork_rng`` so the probe's dropout leaves the training RNG stream untouched.
    """
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        y = torch.randn(2, 3, 4, requires_grad=True)
        bias = torch.zeros(4, requires_grad=True)
        out = ops.bias_dropout_add(ops.bias_gelu(y, bias), bias, y, 0.1, True)
        out.sum().backward()


def compile_layers(layers, sample_shape: tuple[int, ...], dtype) -> bool:
    """``--compile`` on a GPU: ``torch.compile`` each transformer layer (as torchtitan does per block), so
    Inductor fuses LayerNorm, bias, GeLU, dropout and residual adds around the GEMMs and attention.

    Only on CUDA: on the CPU the fused element-wise ops above are compiled instead (Inductor's C++ code for
    whole layers gains little there and takes minutes to build), so CPU numbers stay what they were.
    Layers share one compiled graph (parameters are graph inputs). The forward and backward are compiled
    now, on a throw-away input of the training shape ``sample_shape`` under ``fork_rng``, so a failure
    shows here: then every layer runs eagerly after a one-line warning. Returns whether layers compiled.
    """
    layers = list(layers)
    params = [p for layer in layers for p in layer.parameters()]
    if not layers or not params or not params[0].is_cuda:
        return False
    device = params[0].device
    try:
        for layer in layers:
            layer.compile()
        with torch.random.fork_rng(devices=[device]), torch.enable_grad():
            x = torch.randn(sample_shape, device=device, dtype=dtype, requires_grad=True)
            layers[0](x).float().sum().backward()
        for p in params:
            p.grad = None
        return True
    except Exception as e:  # a compiler failure must never stop training: run the layers eagerly
        for layer in layers:
            layer._compiled_call_impl = None
        for p in params:
            p.grad = None
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        warnings.warn(f"--compile: compiling the transformer layers failed ({reason}); running them eagerly",
                      stacklevel=2)
        return False
