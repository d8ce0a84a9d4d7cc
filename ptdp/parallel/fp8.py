"""FP8 training of the transformer layers' GEMMs through torchao's float8 (``--fp8-format``).

Megatron-LM's flags: ``--fp8-format e4m3`` casts inputs, weights and output gradients to e4m3;
``--fp8-format hybrid`` keeps e4m3 in the forward and uses e5m2 (more range, less precision) for the
gradients. ``--fp8-recipe`` picks torchao's scaling: ``tensorwise`` (one dynamic scale per tensor, cuBLAS'
FP8 GEMM: the fastest) or ``rowwise`` (one scale per row, CUTLASS' kernel: more accurate).

Only the column/row-parallel linears inside transformer layers go FP8 (QKV, projection, FC1, FC2): the
embedding, the output layer (a vocabulary-parallel embedding matrix) and any MoE router stay bf16, as
their numerics are the sensitive ones. The model keeps its bf16 parameters and fp32 main weights; each
GEMM casts its operands with fresh scales (dynamic scaling), so checkpoints are unchanged by FP8.

The hook is one attribute: ``ColumnParallelLinear``/``RowParallelLinear`` call ``self.fp8_linear`` instead
of their plain GEMM when it is set. Those GEMMs then compute their weight gradient in the ordinary
backward (a zero-bubble schedule's W pass has nothing to do for them, as under ``--compile``). torchao is
imported only when FP8 is asked for; torch's FP8 GEMM needs a GPU of compute capability >= 8.9 (H100,
L40, RTX 4090); ``emulate=True`` (tests) runs the same casts with high-precision GEMMs on any device.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ptdp.config.features import FP8_FORMATS, FP8_RECIPES

_SKIPPED = ("router", "output_layer", "embedding")  # module-name parts that always stay bf16


def fp8_environment_errors(config) -> list[str]:
    """One line per reason ``--fp8-format`` cannot run on this machine: torchao installed, a GPU of compute
    capability >= 8.9 visible. A start-up check (``ptdp.cli.main.start_problems``), not a property of the configuration."""
    if not config.precision.fp8_format:
        return []
    if importlib.util.find_spec("torchao") is None:
        return ["--fp8-format needs torchao (pip install torchao, or pip install 'ptdp[fp8]')"]
    if not torch.cuda.is_available():
        return ["--fp8-format needs a CUDA GPU of compute capability >= 8.9 (H100, L40, RTX 4090); none is visible"]
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return [f"--fp8-format needs a GPU of compute capability >= 8.9 (H100, L40, RTX 4090); "
                f"{torch.cuda.get_device_name()} is {major}.{minor}"]
    return []


def float8_config(fmt: str, recipe: str = "tensorwise", emulate: bool = False):
    """torchao's ``Float8LinearConfig`` for ``--fp8-format fmt --fp8-recipe recipe``."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.config import e4m3_dtype, e5m2_dtype

    if fmt not in FP8_FORMATS:
        raise ValueError(f"--fp8-format {fmt!r} is not one of {', '.join(FP8_FORMATS)}")
    if recipe not in FP8_RECIPES:
        raise ValueError(f"--fp8-recipe {recipe!r} is not one of {', '.join(FP8_RECIPES)}")
    config = Float8LinearConfig.from_recipe_name(recipe)
    grad_dtype = e5m2_dtype if fmt == "hybrid" else e4m3_dtype
    changes = {"cast_config_grad_output": dataclasses.replace(config.cast_config_grad_output, target_dtype=grad_dtype)}
    if config.cast_config_grad_output_for_grad_weight is not None:  # one replace: torchao checks they agree
        changes["cast_config_grad_output_for_grad_weight"] = dataclasses.replace(
            config.cast_config_grad_output_for_grad_weight, target_dtype=grad_dtype)
    config = dataclasses.replace(config, emulate=emulate, **changes)
    return config


def fp8_linear(config) -> Callable[..., torch.Tensor]:
    """``f(x, weight, bias=None)``: ``x @ weight.flatten(0, -2).T + bias`` with FP8 operands, the GEMM being
    torchao's autograd function (the same one its ``Float8Linear`` runs)."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    def mm(fast_accum: bool) -> ScaledMMConfig:
        return ScaledMMConfig(config.emulate, fast_accum, False, config.pad_inner_dim)

    mm_config = LinearMMConfig(mm(config.gemm_config_output.use_fast_accum),
                               mm(config.gemm_config_grad_input.use_fast_accum),
                               mm(config.gemm_config_grad_weight.use_fast_accum))

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        w = weight.flatten(0, -2) if weight.dim() > 2 else weight
        y = matmul_with_hp_or_float8_args.apply(x, w.t(), mm_config, config)
        return y if bias is None else y + bias.flatten().to(y.dtype)

    return linear


def fp8_modules(chunks: Iterable[nn.Module]) -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs that go FP8: column/row-parallel linears inside transformer layers, whose
    dimensions FP8 GEMMs accept (multiples of 16), never the embedding, output layer or a router."""
    from ptdp.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

    out = []
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                continue
            if any(part in name for part in _SKIPPED) or not name.startswith("layers."):
                continue
            rows, cols = module.weight.flatten(0, -2).shape
            if rows % 16 == 0 and cols % 16 == 0:
                out.append((name, module))
    return out


def enable_fp8(chunks: Iterable[nn.Module], fmt: str, recipe: str = "tensorwise",
               emulate: bool = False) -> list[str]:
    """Switch the transformer layers' linears of ``chunks`` to FP8 GEMMs; returns the names switched."""
    linear = fp8_linear(float8_config(fmt, recipe, emulate))
    switched = []
    for name, module in fp8_modules(chunks):
        module.fp8_linear = linear
        switched.append(name)
    return switched
