"""Megatron-Core's gradient-buffer layout, rebuilt from a checkpoint's args and model tensors.

Megatron-LM's default distributed-optimizer format (``dp_reshardable``) stores the Adam state as Megatron's
``DistributedDataParallel`` lays out its flat gradient buffers: per model-parallel rank (index
``dp_group_idx_<tp + t·pp>``), per buffer (one per parameter dtype) and per bucket, one flat tensor per field
(``param``, ``exp_avg``, ``exp_avg_sq``) whose length is the bucket's element count without its end padding.
Where each parameter sits in it is not written down; Megatron derives it from the module, so ptdp does too:

- the rank's parameters in ``named_parameters`` order (the module's registration order: embedding, position
  embedding, each local layer, the final norm, the output layer), placed in reverse (backward order);
- each parameter starts at a multiple of 64 elements (counted from the buffer's start);
- a bucket closes once it holds at least ``bucket_size`` elements; ``bucket_size`` is ``ddp_bucket_size``
  (default ``max(4e7, 1e6·dp)``), none (one bucket) without ``overlap_grad_reduce``, and none on pipeline
  stages after the first;
- a tied embedding's copy split over pipeline stages (``shared_embedding``) gets a bucket of its own;
- a bucket's end is padded to a multiple of ``lcm(dp, 128)`` (``lcm(dp, 128, 65536)`` with
  ``ddp_pad_buckets_for_high_nccl_busbw``), which moves the next bucket's start.

The rebuilt layout is checked against what the checkpoint does record (each bucket's element count and
the boundaries of the pieces each rank wrote) before a value is read, so a layout ptdp got wrong is refused
rather than imported as other numbers. Torch-free; ``ptdp.megatron.optim`` reads the tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ptdp.megatron.args import MegatronError

# a layer's parameters in registration order, by Megatron suffix; the two specs differ where the input norm
# lives (its own module before the attention in the local spec, inside linear_qkv after linear_proj in TE's)
_ATTENTION = ("self_attention.linear_proj.weight", "self_attention.linear_proj.bias")
_NORM = ("self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias")
_REST = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
         "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight",
         "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias",
         "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")
LAYER_ORDER = {"local": _NORM + _ATTENTION + _REST, "transformer_engine": _ATTENTION + _NORM + _REST}
PARAM_ALIGN = 64  # elements: Megatron starts each parameter 128-byte aligned for 16-bit values


@dataclass(frozen=True)
class Param:
    """One parameter of a rank's module: its name (Megatron's per-layer name), local element count and
    whether it is a tied embedding's pipeline copy (a bucket of its own)."""

    name: str
    numel: int
    shared_embedding: bool = False


@dataclass(frozen=True)
class Bucket:
    """One bucket: its element count with and without end padding, each parameter's ``[start, end)``
    counted from the bucket's start (the index into the checkpoint's flat tensor)."""

    numel: int
    numel_unpadded: int
    places: dict[str, tuple[int, int]]


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def bucket_layout(params: Sequence[Param], dp: int, bucket_size: int | None, high_busbw: bool = False) -> list[Bucket]:
    """The buckets of one buffer holding ``params`` (registration order), as Megatron's DDP builds them with
    the distributed optimizer over ``dp`` data-parallel ranks."""
    divisor = math.lcm(dp, 128, 2 ** 16) if high_busbw else math.lcm(dp, 128)
    buckets: list[Bucket] = []
    places: dict[str, tuple[int, int]] = {}
    bucket_start = cursor = 0

    def close(end: int) -> int:
        nonlocal places, bucket_start
        padded = _round_up(end, divisor)
        buckets.append(Bucket(padded - bucket_start, end - bucket_start,
                              {k: (a - bucket_start, b - bucket_start) for k, (a, b) in places.items()}))
        places, bucket_start = {}, padded
        return padded

    for param in reversed(params):
        cursor = _round_up(cursor, PARAM_ALIGN)
        if param.shared_embedding and places:
            cursor = close(cursor)
        end = cursor + param.numel
        places[param.name] = (cursor, end)
        full = bucket_size is not None and end - bucket_start >= bucket_size
        cursor = close(end) if full or param.shared_embedding else end
    if places:
        close(cursor)
    return buckets


def rank_params(shapes: dict[str, tuple[int, ...]], args: dict[str, Any], tp: int, pp: int) -> list[Param]:
    """The parameters of model-parallel rank (``tp``, ``pp``) in registration order: ``shapes`` are the full
    per-layer tensors' (Megatron names), each split as Megatron's tensor parallelism splits it."""
    from ptdp.megatron.names import EMBEDDING, OUTPUT, POSITIONS, split_dim

    t, p = int(args.get("tensor_model_parallel_size") or 1), int(args.get("pipeline_model_parallel_size") or 1)
    impl = args.get("transformer_impl")
    if impl not in LAYER_ORDER:
        raise MegatronError(f"--in: the checkpoint's args set transformer_impl={impl!r}; ptdp rebuilds the gradient "
                            f"buffers of {' and '.join(LAYER_ORDER)} layers (save with --dist-ckpt-optim-fully-reshardable)")
    per_stage = int(args["num_layers"]) // p
    tied = not args.get("untie_embeddings_and_output_weights")
    names: list[str] = []
    if pp == 0:
        names += [n for n in (EMBEDDING, POSITIONS) if n in shapes]
    for i in range(pp * per_stage, (pp + 1) * per_stage):
        prefix = f"decoder.layers.{i}."
        present = {n.removeprefix(prefix) for n in shapes if n.startswith(prefix)}
        unknown = sorted(present - set(LAYER_ORDER[impl]))
        if unknown:
            raise MegatronError(f"--in: the checkpoint holds {prefix}{unknown[0]}, whose place in Megatron's gradient "
                                "buffer ptdp does not know (save with --dist-ckpt-optim-fully-reshardable)")
        names += [prefix + s for s in LAYER_ORDER[impl] if s in present]
    if pp == p - 1:
        names += [n for n in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias") if n in shapes]
        if not tied or p > 1:
            names.append(OUTPUT)
    out = []
    for name in names:
        shape = shapes[EMBEDDING] if name == OUTPUT and name not in shapes else shapes[name]
        dim = split_dim(name)
        numel = math.prod(shape) // (t if dim is not None else 1)
        shared = tied and p > 1 and ((name == EMBEDDING and pp == 0) or (name == OUTPUT and pp == p - 1))
        out.append(Param(name, numel, shared))
    return out


def layout_args(args: dict[str, Any]) -> tuple[int, int | None, bool]:
    """(dp, bucket size of the first pipeline stage, high-busbw padding) from the run's args; what changes
    the layout in ways ptdp does not rebuild is refused by name."""
    for name, plain in (("virtual_pipeline_model_parallel_size", None), ("num_distributed_optimizer_instances", 1),
                        ("decoder_first_pipeline_num_layers", None), ("decoder_last_pipeline_num_layers", None),
                        ("pipeline_model_parallel_layout", None), ("num_experts", None), ("fp8_param_gather", False),
                        ("use_megatron_fsdp", False)):
        if args.get(name) not in (plain, None, False):
            raise MegatronError(f"--in: the checkpoint's args set {name}={args[name]!r}; ptdp rebuilds Megatron's "
                                "gradient buffers (dp_reshardable) without it (save with --dist-ckpt-optim-fully-reshardable)")
    for name in ("data_parallel_size", "use_distributed_optimizer"):
        if not args.get(name):
            raise MegatronError(f"--in: the checkpoint's args lack {name}, which Megatron's gradient-buffer layout "
                                "(dp_reshardable) depends on")
    d = int(args["data_parallel_size"])
    size = None
    if args.get("overlap_grad_reduce") and not args.get("overlap_param_gather_with_optimizer_step"):
        size = args.get("ddp_bucket_size") or max(40_000_000, 1_000_000 * d)
    dp = d * int(args.get("context_parallel_size") or 1)  # the buffers shard over data and context ranks
    return dp, size, bool(args.get("ddp_pad_buckets_for_high_nccl_busbw"))


def shifted_by_padding(shapes: dict[str, tuple[int, ...]], args: dict[str, Any]) -> bool:
    """Whether a ``fully_reshardable`` save of this run holds shifted values: megatron-core (0.16.1) gathers
    each buffer with its buckets' end padding dropped, then slices each parameter at its offset in the
    padded buffer, so every parameter after a padded bucket end is read from the wrong place. One bucket
    per buffer (no ``overlap_grad_reduce``, no tied embedding split over pipeline stages) is never shifted."""
    t, p = int(args.get("tensor_model_parallel_size") or 1), int(args.get("pipeline_model_parallel_size") or 1)
    if not args.get("overlap_grad_reduce") and (p == 1 or args.get("untie_embeddings_and_output_weights")):
        return False
    dp, size, high_busbw = layout_args(args)
    for pp in range(p):
        for tp in range(t):
            buckets = bucket_layout(rank_params(shapes, args, tp, pp), dp, size if pp == 0 else None, high_busbw)
            if any(b.numel != b.numel_unpadded for b in buckets[:-1]):
                return True
    return False
