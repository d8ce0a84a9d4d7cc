"""Model-state memory per rank: counted from the tensors actually held, and the formula it must equal.

``model_state_bytes`` walks what a rank keeps between iterations -- the model's parameters, their
gradients (``.grad``, the flat ``main_grad`` buffers and their shards), the optimizer's main parameters
and state -- and adds the size of every *distinct* storage once. A view
costs nothing beyond the buffer it points into (fp32 ZeRO-1's main parameters are views of the flat
parameter buffer), and a full-size tensor kept beside a shard shows up as the bytes it costs. That is
what makes it a check rather than a restatement of :func:`model_state_formula_bytes`, which is the
accounting of ZeRO (Rajbhandari et al.) and Megatron's distributed optimizer (docs/references.md, §Memory):

* fp32: 4 (parameters) + 4 (gradients) + 8 (Adam) bytes per parameter -> 8 + 8/d sharded;
* bf16 parameters with fp32 gradients: 2 + 4 + 4 (fp32 main copy) + 8 = 18 -> 6 + 12/d;
* fp16 parameters and fp16 gradients: 2 + 2 + 4 (fp32 main grad) + 4 + 8 = 20 -> 4 + 16/d.

``--optimizer muon`` keeps one fp32 momentum (4 bytes) for the hidden matrices instead of Adam's 8, SGD one
for every parameter (``state_bytes``; docs/references.md, §Muon).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from ptdp.optim.optimizer import MegatronOptimizer
from ptdp.parallel.data.protocol import GradReducer

CATEGORIES = ("params", "grads", "optimizer")


def _torch_optimizer(optimizer: MegatronOptimizer | torch.optim.Optimizer | None) -> torch.optim.Optimizer | None:
    return optimizer.optimizer if isinstance(optimizer, MegatronOptimizer) else optimizer


def _optimizer_tensors(optimizer) -> Iterator[torch.Tensor]:
    """Main parameters, their ``.grad`` and every state tensor of the torch optimizer inside ``optimizer``
    (a :class:`~ptdp.optim.MegatronOptimizer`, or a plain ``torch.optim.Optimizer``)."""
    inner = _torch_optimizer(optimizer)
    for group in inner.param_groups:
        for p in group["params"]:
            yield p
            if p.grad is not None:
                yield p.grad
    for state in inner.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _held(params: Iterable[nn.Parameter], grads: GradReducer | None, optimizer) -> Iterator[tuple[str, torch.Tensor]]:
    params = list(params)
    for p in params:
        yield "params", p
    for p in params:
        if p.grad is not None:
            yield "grads", p.grad
    for bucket in grads.buckets if grads is not None else ():  # main_grad: views of these
        yield from bucket.tensors()
    for bucket in grads.frozen_buckets if grads is not None else ():  # ZeRO-3's shards of frozen weights
        yield from (("params", t) for _, t in bucket.tensors() if t.numel())
    if optimizer is not None:
        for t in _optimizer_tensors(optimizer):
            yield "optimizer", t


def model_state_bytes(params: Iterable[nn.Parameter], grads: GradReducer | None = None,
                      optimizer=None) -> dict[str, int]:
    """Bytes of the distinct storages this rank holds for its model states, by category, and ``total``.

    ``grads`` is the rank's gradient reducer (or None), ``optimizer`` its optimizer (or None). A storage is
    counted once, under the first category that reaches it (params, grads, optimizer), at its whole size: a view into a buffer costs nothing more, a copy costs its bytes.
    """
    seen: set[tuple[str, int]] = set()
    out = dict.fromkeys(CATEGORIES, 0)
    for category, tensor in _held(params, grads, optimizer):
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr())  # the device itself: str() of it costs more than the rest
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        out[category] += storage.nbytes()
    out["total"] = sum(out[c] for c in CATEGORIES)
    return out


def model_states_at_start(params: Iterable[nn.Parameter], grads: GradReducer | None = None,
                          optimizer=None) -> dict[str, int]:
    """:func:`model_state_bytes` before the first step, plus the state the optimizer will allocate at it
    (``MegatronOptimizer.pending_state_bytes``: e.g. AdamW's two moments per parameter, Muon's one momentum
    per hidden-matrix parameter; for a bare torch optimizer, two) and, under ZeRO-2/3, the gradient
    shards in place of the full buffers (which only the step holds): what the rank will hold in steady
    state, known at start-up (the start-up summary line states it)."""
    out = model_state_bytes(params, grads, optimizer)
    for b in grads.buckets if grads is not None else ():  # ZeRO-2/3 keep a gradient shard; the full buffer
        full = b.grad_data.untyped_storage().nbytes()     # is the step's
        if b.shard_grads and b.grad_shard is None and full:
            shard = (b.shard_end - b.shard_start) * b.grad_data.element_size()
            out["grads"] += shard - full
            out["total"] += shard - full
    inner = _torch_optimizer(optimizer)
    if inner is not None:
        pending = optimizer.pending_state_bytes() if isinstance(optimizer, MegatronOptimizer) else sum(
            2 * p.numel() * p.element_size() for group in inner.param_groups for p in group["params"]
            if not inner.state.get(p))
        out["optimizer"] += pending
        out["total"] += pending
    return out


def model_state_formula_bytes(num_params: int, param_dtype: torch.dtype = torch.float32,
                              grad_dtype: torch.dtype = torch.float32, shards: int = 1,
                              distributed: bool = False, state_bytes: float = 8) -> float:
    """ZeRO's/Megatron's model-state bytes for ``num_params`` parameters on one rank (module docstring).

    What the optimizer owns -- the fp32 main copy (16-bit parameters), the fp32 main gradient (16-bit
    gradients) and its state (``state_bytes`` per parameter: Adam's two fp32 moments; Muon's matrices 4) --
    is divided by ``shards`` (d) when ``distributed``.
    """
    p_bytes = torch.finfo(param_dtype).bits // 8
    g_bytes = torch.finfo(grad_dtype).bits // 8
    owned = state_bytes + (4 if param_dtype != torch.float32 else 0) + (4 if grad_dtype != torch.float32 else 0)
    return num_params * (p_bytes + g_bytes + owned / (shards if distributed else 1))


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (Linux), 0 where /proc is not there. Read with ``os`` calls
    (not a text file object): this runs at every logged iteration."""
    try:
        fd = os.open("/proc/self/status", os.O_RDONLY)
        try:
            status = os.read(fd, 1 << 14)
        finally:
            os.close(fd)
    except OSError:
        return 0
    start = status.find(field.encode() + b":")
    if start < 0:
        return 0
    return int(status[start + len(field) + 1:status.index(b"kB", start)]) * 1024


_lifetime_peak = {"rss": 0, "cuda": 0}  # the window peaks are reset (below): the run's peaks are kept here


def peak_resident_bytes() -> int:
    """This process's peak resident set over the whole run (``VmHWM``, and the peaks of earlier windows)."""
    _lifetime_peak["rss"] = max(_lifetime_peak["rss"], _status_bytes("VmHWM"))
    return _lifetime_peak["rss"]


def window_peak_bytes(device: torch.device) -> int:
    """Peak memory since the previous call (the iterations of one metrics window), then reset: the device's
    ``max_memory_allocated`` on a GPU, the resident set's high-water mark on the CPU (reset through
    ``/proc/self/clear_refs``; where that is not writable it stays the run's peak). The run's peaks
    (:func:`peak_resident_bytes`, ``_lifetime_peak["cuda"]``) take this window's in first."""
    resident = _status_bytes("VmHWM")  # read once: this window's resident peak, and the run's
    _lifetime_peak["rss"] = max(_lifetime_peak["rss"], resident)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        _lifetime_peak["cuda"] = max(_lifetime_peak["cuda"], peak)
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    try:
        fd = os.open("/proc/self/clear_refs", os.O_WRONLY)
        try:
            os.write(fd, b"5")  # VmHWM := VmRSS
        finally:
            os.close(fd)
    except OSError:
        pass
    return resident


class HeldStates:
    """:func:`model_state_bytes`' total for the training loop's reports, walked again only when the tensors
    held are not the same objects as at the previous report: in steady state they are (the optimizer's state
    appears at the first step, a resume loads into the tensors there), and the walk's ``untyped_storage`` of
    some 200 tensors was a third of the loop's own time per logged iteration at nanoGPT's size.
    ZeRO-3 frees and regathers parameter storages inside the same tensors: walked every time there."""

    def __init__(self) -> None:
        self._key: tuple[int, ...] | None = None
        self._total = 0

    def total(self, params: list[nn.Parameter], grads: GradReducer | None, optimizer) -> int:
        if grads is not None and grads.param_sync is not None:
            return model_state_bytes(params, grads, optimizer)["total"]
        key = tuple(id(t) for _, t in _held(params, grads, optimizer))
        if key != self._key:
            self._key, self._total = key, model_state_bytes(params, grads, optimizer)["total"]
        return self._total


def memory_row(states: int, device: torch.device) -> list[float]:
    """This rank's memory numbers, for one gather with the other per-rank numbers of a metrics window:
    ``states`` (its model-state bytes), the window's peak, the run's peak RSS, the run's peak CUDA allocation
    (-1 on CPU). The window's reading has just updated the run's peaks (no second read of ``/proc``)."""
    window = float(window_peak_bytes(device))
    return [float(states), window, float(_lifetime_peak["rss"]),
            float(_lifetime_peak["cuda"]) if device.type == "cuda" else -1.0]


def memory_fields(rows: list[list[float]]) -> dict:
    """The metrics JSONL's memory keys from every rank's :func:`memory_row` (indexed by global rank)."""
    states, window, resident, allocated = (list(col) for col in zip(*rows, strict=True))
    return {
        "model_state_bytes": int(max(states)),
        "model_state_bytes_per_rank": [int(v) for v in states],
        "peak_memory_bytes_per_rank": [int(v) for v in window],
        "peak_resident_bytes_per_rank": [int(v) for v in resident],
        "peak_allocated_bytes_per_rank": None if allocated[0] < 0 else [int(v) for v in allocated],
    }
