"""Materialise a model built on the meta device, with the values one process would draw.

Each full parameter is drawn from its own generator, seeded by (seed, logical name), so the full model is
the same whatever t, p and d are, and the two copies of the tied embedding start equal. Only one full
parameter exists at a time, so even a trillion-parameter model can start; where flat parameter buffers
will hold the weights (:func:`defer_init`), the draws go straight into them, so a ZeRO-3 rank never holds
its chunks whole, not even at start-up. Residual output projections are
scaled by 1/sqrt(2 * num_layers) as in GPT-2 and Megatron.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ptdp.config import Config


def materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """Give every meta parameter real (uninitialised) storage on ``device``, keeping its attributes
    (``tensor_model_parallel``, ``sequence_parallel``, ...) and its place in the module; meta buffers start
    at zero (:func:`materialize_buffers`). Returns ``model``."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                new = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                   requires_grad=param.requires_grad)
                new.__dict__.update(param.__dict__)
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


def mark_no_weight_decay(model: nn.Module) -> None:
    """Megatron's rule: biases and norm parameters are not weight-decayed (read by ``ptdp.optim``)."""
    for name, param in model.named_parameters():
        param.no_weight_decay = name.endswith("bias") or "layernorm" in name


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, tp_rank: int, tp_size: int, std: float, num_layers: int,
                    logical_name: Callable[[str], str] = lambda name: name) -> None:
    """Initialise every parameter as the full model would be, then keep this rank's tensor-parallel piece.

    ``logical_name`` maps a local parameter name to the full model's (a pipeline stage's copy of the tied
    embedding is the embedding: ``ptdp.parallel.pipeline.stage.logical_name``).
    """
    for name, param in model.named_parameters():
        init_parameter(param, param, logical_name(name), seed, tp_rank, tp_size, std, num_layers)


@torch.no_grad()
def init_parameter(param: nn.Parameter, out: torch.Tensor, name: str, seed: int, tp_rank: int, tp_size: int,
                   std: float, num_layers: int) -> None:
    """Write ``param``'s initial values (logical name ``name``) into ``out`` (``param``'s shape, any dtype:
    the fp32 draw is cast as ``Module.to`` would cast it). ``param`` may be on the meta device."""
    if "layernorm" in name:
        out.fill_(1.0 if name.endswith("weight") else 0.0)
        return
    if name.endswith("bias"):
        out.zero_()
        return
    scaled = name.endswith(("attention.proj.weight", "fc2.weight", "experts.fc2_weight"))  # + MoE experts
    full_shape = list(param.shape)
    parallel = getattr(param, "tensor_model_parallel", False)
    if parallel:
        full_shape[param.partition_dim] *= tp_size
    experts = getattr(param, "expert_parallel_size", 1)  # ptdp.parallel.expert.apply: this rank's experts
    full_shape[0] *= experts
    # Drawn on the CPU whatever the device: CPU and CUDA generators give different numbers, and the
    # model must be the same on every device (a CUDA run reproduces a CPU run; checkpoints move).
    generator = torch.Generator()
    generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    full = torch.empty(full_shape, device="cpu")
    full.normal_(0.0, std / math.sqrt(2.0 * num_layers) if scaled else std, generator=generator)
    if experts > 1:
        full = full.chunk(experts, 0)[param.expert_parallel_rank]
    out.copy_(full.chunk(tp_size, param.partition_dim)[tp_rank] if parallel else full)
    del full


def defer_init(model: nn.Module, device: torch.device, dtype: torch.dtype, seed: int, tp_rank: int,
               tp_size: int, std: float, num_layers: int,
               logical_name: Callable[[str], str] = lambda name: name) -> nn.Module:
    """:func:`materialize` + :func:`init_parameters` + ``.to(dtype)``, deferred: each meta parameter becomes
    a ``dtype`` parameter on ``device`` with *no storage* (as a ZeRO-3 parameter between gathers), carrying
    ``param.deferred_init(out)``, which writes into ``out`` exactly what :func:`init_parameters` would
    have drawn for it. The flat parameter buffers (``ptdp.parallel.data.buffer``) call it on the parameter's
    view of them, bucket by bucket, so a rank that keeps only shards (ZeRO-3) never holds the whole model,
    not even at start-up; :func:`materialize_deferred` serves parameters outside any buffer."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            new = nn.Parameter(_unallocated(param.shape, dtype, device), requires_grad=param.requires_grad)
            new.__dict__.update(param.__dict__)
            module._parameters[name] = new
    for name, param in model.named_parameters():
        if param.numel() > 0 and param.untyped_storage().nbytes() == 0:
            param.deferred_init = functools.partial(init_parameter, param, name=logical_name(name), seed=seed,
                                                    tp_rank=tp_rank, tp_size=tp_size, std=std, num_layers=num_layers)
    return materialize_buffers(model, device)


def _unallocated(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous tensor of ``shape`` whose storage is freed (``untyped_storage().resize_(0)``)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    t.untyped_storage().resize_(0)
    return t


@torch.no_grad()
def materialize_deferred(params: Iterable[nn.Parameter]) -> None:
    """Allocate and initialise the deferred parameters nobody took (e.g. frozen ones: no gradient buffer)."""
    for param in params:
        init = param.__dict__.pop("deferred_init", None)
        if init is not None:
            param.untyped_storage().resize_(param.numel() * param.element_size())
            init(param.data)


def params_dtype(config: Config) -> torch.dtype:
    """The model's parameter (and activation) dtype."""
    mp = config.precision
    return torch.bfloat16 if mp.bf16 else torch.float16 if mp.fp16 else torch.float32
