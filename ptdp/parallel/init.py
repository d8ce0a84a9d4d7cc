"""Materialise a model built on the meta device, with the values one process would draw.

Each full parameter is drawn from its own generator, seeded by (seed, logical name), so the full model is
the same whatever t, p and d are, and the two copies of the tied embedding start equal; each rank keeps
the piece its placement record says (``ptdp.parallel.placement``: TP, expert and vocabulary splits
alike). Only one full parameter exists at a time, so even a trillion-parameter model can start; where flat
parameter buffers will hold the weights (:func:`defer_init`), the draws go straight into them, so a ZeRO-3
rank never holds its chunks whole, not even at start-up. Residual output projections are scaled by
1/sqrt(2 * num_layers) as in GPT-2 and Megatron.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable

import torch
from torch import nn

from ptdp.models.layers import ZeroCenteredRMSNorm
from ptdp.parallel.placement import Placement, Placements


def materialize(model: nn.Module, device: torch.device, placements: Placements) -> nn.Module:
    """Give every meta parameter real (uninitialised) storage on ``device``, keeping its record in
    ``placements`` and its place in the module; meta buffers start at zero (:func:`materialize_buffers`).
    Returns ``model``."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                new = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                   requires_grad=param.requires_grad)
                placements.replace(param, new)
                module._parameters[name] = new
    return materialize_buffers(model, device)


def materialize_buffers(model: nn.Module, device: torch.device) -> nn.Module:
    """Meta buffers become zeros on ``device``: the model's buffers all start at zero (a router's expert
    bias and token counts, ``ptdp.models.moe``), the same in every layout."""
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.zeros(buffer.shape, dtype=buffer.dtype, device=device)
    return model


def record_weight_decay(model: nn.Module, placements: Placements) -> None:
    """Megatron's rule: biases and norm parameters are not weight-decayed (read by ``ptdp.optim``)."""
    for name, param in model.named_parameters():
        placements.update(param, weight_decay=not (name.endswith("bias") or "layernorm" in name))


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, std: float, num_layers: int,
                    placements: Placements | None = None) -> None:
    """Initialise every parameter as the full model would be, then keep this rank's piece.

    ``placements`` gives each parameter's full-model name (a pipeline stage's copy of the tied embedding is
    the embedding) and the splits that make this rank's piece; a parameter it does not know (a plain
    one-process model: ``placements`` None) is whole, under its name in ``model``.
    """
    zero = _zero_centred(model)
    for name, param in model.named_parameters():
        placement = None if placements is None else placements.get(param)
        init_parameter(placement or Placement(name), param, seed, std, num_layers, norm_weight=float(param not in zero))


def _zero_centred(model: nn.Module) -> set[nn.Parameter]:
    """The weights of ``--apply-layernorm-1p``'s norms, y = norm(x)·(1 + w): they start at 0, not 1."""
    return {p for m in model.modules() if isinstance(m, ZeroCenteredRMSNorm) for p in m.parameters(recurse=False)}


@torch.no_grad()
def init_parameter(placement: Placement, out: torch.Tensor, seed: int, std: float, num_layers: int,
                   norm_weight: float = 1.0) -> None:
    """Write the initial values of ``placement``'s piece into ``out`` (the piece's shape, any dtype: the
    fp32 draw is cast as ``Module.to`` would cast it); a norm's weight is ``norm_weight`` (0: zero-centred)."""
    name = placement.name
    if "layernorm" in name:
        out.fill_(norm_weight if name.endswith("weight") else 0.0)
        return
    if name.endswith(("bias", ".lora_B")):  # a LoRA adapter's B starts at zero: the model starts unchanged
        out.zero_()
        return
    scaled = name.endswith(("attention.proj.weight", "fc2.weight", "experts.fc2_weight"))  # + MoE experts
    # Drawn on the CPU whatever the device: CPU and CUDA generators give different numbers, and the
    # model must be the same on every device (a CUDA run reproduces a CPU run; checkpoints move).
    generator = torch.Generator()
    generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    full = torch.empty(placement.full_shape(out.shape), device="cpu")
    if name.endswith(".lora_A"):  # PEFT's: Kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))
        bound = 1.0 / math.sqrt(full.shape[-1])
        full.uniform_(-bound, bound, generator=generator)
    else:
        full.normal_(0.0, std / math.sqrt(2.0 * num_layers) if scaled else std, generator=generator)
    out.copy_(placement.piece(full))
    del full


class DeferredInit:
    """The parameters :func:`defer_init` left without storage, each with the function that draws its
    initial values into a tensor of its shape. The flat parameter buffers (``ptdp.parallel.data.buffer``)
    :meth:`pop` it and call it on the parameter's view of them; :meth:`materialize_rest` serves the
    parameters no buffer took (e.g. frozen ones)."""

    def __init__(self) -> None:
        self._draws: dict[nn.Parameter, Callable[[torch.Tensor], None]] = {}

    def __len__(self) -> int:
        return len(self._draws)

    def add(self, param: nn.Parameter, draw: Callable[[torch.Tensor], None]) -> None:
        self._draws[param] = draw

    def pop(self, param: nn.Parameter) -> Callable[[torch.Tensor], None] | None:
        return self._draws.pop(param, None)

    @torch.no_grad()
    def materialize_rest(self) -> None:
        """Allocate and initialise the deferred parameters nobody took."""
        for param, draw in self._draws.items():
            param.untyped_storage().resize_(param.numel() * param.element_size())
            draw(param.data)
        self._draws.clear()


def defer_init(model: nn.Module, device: torch.device, dtype: torch.dtype, placements: Placements,
               deferred: DeferredInit, seed: int, std: float, num_layers: int) -> nn.Module:
    """:func:`materialize` + :func:`init_parameters` + ``.to(dtype)``, deferred: each meta parameter becomes
    a ``dtype`` parameter on ``device`` with *no storage* (as a ZeRO-3 parameter between gathers), and
    ``deferred`` gets the function that writes into a tensor exactly what :func:`init_parameters` would have
    drawn for it. The flat parameter buffers call it on the parameter's view of them, bucket by bucket, so
    a rank that keeps only shards (ZeRO-3) never holds the whole model, not even at start-up."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            new = nn.Parameter(_unallocated(param.shape, dtype, device), requires_grad=param.requires_grad)
            placements.replace(param, new)
            module._parameters[name] = new
    zero = _zero_centred(model)
    for param in model.parameters():
        if param.numel() > 0 and param.untyped_storage().nbytes() == 0:
            deferred.add(param, functools.partial(init_parameter, placements[param], seed=seed, std=std,
                                                  num_layers=num_layers, norm_weight=float(param not in zero)))
    return materialize_buffers(model, device)


def _unallocated(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous tensor of ``shape`` whose storage is freed (``untyped_storage().resize_(0)``)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    t.untyped_storage().resize_(0)
    return t

