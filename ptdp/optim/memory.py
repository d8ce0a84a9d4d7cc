"""Model-state memory per rank: counted from the tensors actually held, and the formula it must equal.

``model_state_bytes`` walks what a rank keeps between iterations -- the model's parameters, their
gradients (``.grad``, the flat ``main_grad`` buffers), the optimizer's main parameters and Adam state,
and any communication buffer a bucket holds -- and adds the size of every *distinct* storage once. A view
costs nothing beyond the buffer it points into (fp32 ZeRO-1's main parameters are views of the flat
parameter buffer), and a full-size tensor kept beside a shard shows up as the bytes it costs. That is
what makes it a check rather than a restatement of :func:`model_state_formula_bytes`, which is the
accounting of ZeRO (Rajbhandari et al.) and Megatron's distributed optimizer (ptdp-facts.md, §Memory):

* fp32: 4 (parameters) + 4 (gradients) + 8 (Adam) bytes per parameter -> 8 + 8/d sharded;
* bf16 parameters with fp32 gradients: 2 + 4 + 4 (fp32 main copy) + 8 = 18 -> 6 + 12/d;
* fp16 parameters and fp16 gradients: 2 + 2 + 4 (fp32 main grad) + 4 + 8 = 20 -> 4 + 16/d.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

CATEGORIES = ("params", "grads", "optimizer", "comm")


def _optimizer_tensors(optimizer) -> Iterator[torch.Tensor]:
    """Main parameters, their ``.grad`` and every state tensor of the torch optimizer inside ``optimizer``
    (a :class:`~ptdp.optim.MegatronOptimizer`, or a plain ``torch.optim.Optimizer``)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    for group in inner.param_groups:
        for p in group["params"]:
            yield p
            if p.grad is not None:
                yield p.grad
    for state in inner.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _held(params: Iterable[nn.Parameter], grads, optimizer) -> Iterator[tuple[str, torch.Tensor]]:
    params = list(params)
    for p in params:
        yield "params", p
    for p in params:
        for grad in (p.grad, getattr(p, "main_grad", None)):
            if grad is not None:
                yield "grads", grad
    for bucket in getattr(grads, "buckets", ()):
        if bucket.param_data is not None:
            yield "params", bucket.param_data
        yield "grads", bucket.grad_data
        if getattr(bucket, "param_shard", None) is not None:  # ZeRO-3's persistent parameter shard
            yield "params", bucket.param_shard
        if getattr(bucket, "grad_shard", None) is not None:  # ZeRO-2/3's persistent gradient shard
            yield "grads", bucket.grad_shard
        if bucket.shard_out is not None:
            yield "comm", bucket.shard_out
    if optimizer is not None:
        for t in _optimizer_tensors(optimizer):
            yield "optimizer", t


def model_state_bytes(params: Iterable[nn.Parameter], grads=None, optimizer=None) -> dict[str, int]:
    """Bytes of the distinct storages this rank holds for its model states, by category, and ``total``.

    ``grads`` is the rank's :class:`~ptdp.optim.GradBuckets` (or None), ``optimizer`` its optimizer (or
    None). A storage is counted once, under the first category that reaches it (params, grads, optimizer,
    comm), at its whole size: a view into a buffer costs nothing more, a copy costs its bytes.
    """
    seen: set[tuple[str, int]] = set()
    out = dict.fromkeys(CATEGORIES, 0)
    for category, tensor in _held(params, grads, optimizer):
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        out[category] += storage.nbytes()
    out["total"] = sum(out[c] for c in CATEGORIES)
    return out


def model_state_formula_bytes(num_params: int, param_dtype: torch.dtype = torch.float32,
                              grad_dtype: torch.dtype = torch.float32, shards: int = 1,
                              distributed: bool = False) -> float:
    """ZeRO's/Megatron's model-state bytes for ``num_params`` parameters on one rank (module docstring).

    What the optimizer owns -- the fp32 main copy (16-bit parameters), the fp32 main gradient (16-bit
    gradients) and Adam's two fp32 moments -- is divided by ``shards`` (d) when ``distributed``.
    """
    p_bytes = torch.finfo(param_dtype).bits // 8
    g_bytes = torch.finfo(grad_dtype).bits // 8
    owned = 8 + (4 if param_dtype != torch.float32 else 0) + (4 if grad_dtype != torch.float32 else 0)
    return num_params * (p_bytes + g_bytes + owned / (shards if distributed else 1))


def peak_resident_bytes() -> int:
    """This process's peak resident set (``VmHWM``, Linux), 0 where /proc is not there."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def memory_report(params: Iterable[nn.Parameter], grads, optimizer, device: torch.device) -> dict:
    """Per-rank ``model_state_bytes`` (distinct storages held) and peak memory, for the metrics JSONL.

    Collective over the world (one all-gather): every rank calls it; lists are indexed by global rank.
    ``peak_resident_bytes``: the process's peak RSS; ``peak_allocated_bytes``: CUDA's
    ``max_memory_allocated`` (None on the CPU).
    """
    row = [float(model_state_bytes(params, grads, optimizer)["total"]), float(peak_resident_bytes()),
           float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else -1.0]
    local = torch.tensor(row, dtype=torch.float64, device=device)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        rows = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(rows, local)
    else:
        rows = [local]
    states, resident, allocated = (list(col) for col in zip(*(r.tolist() for r in rows), strict=True))
    return {
        "model_state_bytes": int(max(states)),
        "model_state_bytes_per_rank": [int(v) for v in states],
        "peak_resident_bytes_per_rank": [int(v) for v in resident],
        "peak_allocated_bytes_per_rank": None if allocated[0] < 0 else [int(v) for v in allocated],
    }
