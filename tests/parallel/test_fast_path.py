"""What a CPU can prove of the GPU fast path: collectives on old torch, no host syncs in the
steady state, the in-place cross entropy, RNG streams, and device-independent checkpoints.

The GPU half (the same code on CUDA, bf16, sync-debug mode) is tests/gpu/test_gpu.py (``pytest -m gpu``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import TINY, spawn, validated_config

from ptdp.parallel.tensor import random as tp_random
from ptdp.parallel.tensor.cross_entropy import mask_padded_vocab_, vocab_parallel_cross_entropy

# ------------------------------------------------------------------ ZeRO-1 collectives on torch < 2.10


def _zero1_with_old_collective_names(rank: int, world: int) -> None:
    """torch < 2.10 has neither ``reduce_scatter_single`` nor ``all_gather_single``: hide them, count the
    fallbacks, and check the sharded AdamW still equals torch's AdamW on the full batch."""
    from test_distributed_optimizer import _check_matches_torch_adamw

    for name in ("reduce_scatter_single", "all_gather_single"):
        if hasattr(dist, name):
            delattr(dist, name)
    calls = {"reduce_scatter_tensor": 0, "all_gather_into_tensor": 0}
    for name in calls:
        original = getattr(dist, name)

        def counting(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counting)
    _check_matches_torch_adamw(rank, world, overlap=False)  # on gloo its reduction is an in-place all-reduce
    _check_gather_and_reduce_scatter(rank, world)
    assert calls["reduce_scatter_tensor"] > 0 and calls["all_gather_into_tensor"] > 0, calls


def _check_gather_and_reduce_scatter(rank: int, world: int) -> None:
    """The tensor-parallel all-gather / reduce-scatter along any dim (the flat collectives) are torch.cat
    and the sum's chunk, bit for bit, and contiguous."""
    from ptdp.parallel.collectives import all_gather, reduce_scatter

    def piece(r: int, shape) -> torch.Tensor:
        return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) * (r + 1) + 0.25 * r

    group = dist.group.WORLD
    for shape in ((1, 3, 4), (2, 3, 4)):
        for dim in range(3):
            got = all_gather(piece(rank, shape), group, dim)
            assert got.is_contiguous() and torch.equal(got, torch.cat([piece(r, shape) for r in range(world)], dim))
            full = list(shape)
            full[dim] *= world
            got = reduce_scatter(piece(rank, full), group, dim)
            want = sum(piece(r, full) for r in range(world)).chunk(world, dim)[rank]
            assert got.is_contiguous() and torch.equal(got, want), (shape, dim)


def test_distributed_optimizer_on_torch_without_single_collectives(tmp_path):
    spawn(_zero1_with_old_collective_names, 2, tmp_path)


# ------------------------------------------------------------------------- in-place cross entropy


def _out_of_place_reference(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous implementation's arithmetic (three fp32 copies), one rank: (loss, d sum(loss) / d logits)."""
    logits = logits.float()
    shifted = logits - logits.max(dim=-1).values.unsqueeze(-1)
    predicted = shifted.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    exp = shifted.exp()
    sum_exp = exp.sum(dim=-1)
    softmax = exp / sum_exp.unsqueeze(-1)
    grad = softmax.clone()
    grad.scatter_add_(-1, target.unsqueeze(-1), -torch.ones_like(grad[..., :1]))
    return sum_exp.log() - predicted, grad


def _logits(dtype=torch.float32, vocab: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 5, vocab, generator=g)).to(dtype)
    target = torch.randint(0, vocab, (2, 5), generator=g)
    return logits, target


def test_cross_entropy_in_place_is_exact():
    logits, target = _logits()
    ref_loss, ref_grad = _out_of_place_reference(logits, target)
    x = logits.clone().requires_grad_(True)
    work = x * 1.0  # a non-leaf, as the logit GEMM's output is: the loss may overwrite it
    loss = vocab_parallel_cross_entropy(work, target)
    assert torch.equal(loss, ref_loss)  # the same arithmetic, bit for bit
    torch.testing.assert_close(work.sum(-1), torch.ones(2, 5))  # the logits buffer now holds the softmax
    loss.sum().backward()
    assert torch.equal(x.grad, ref_grad)
    # ... and it is the cross entropy: torch's, to fp32 rounding
    y = logits.clone().requires_grad_(True)
    torch_loss = F.cross_entropy(y.flatten(0, 1), target.flatten(), reduction="none").view(2, 5)
    torch_loss.sum().backward()
    torch.testing.assert_close(loss, torch_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-6, atol=1e-6)


def test_cross_entropy_saves_one_fp32_buffer_and_masks_padding():
    """bf16 logits over a padded vocabulary: 4 bytes per logit saved (the fp32 softmax), padding ignored."""
    vocab, padded = 11, 16
    logits, target = _logits(torch.bfloat16, padded)
    x = logits.clone().requires_grad_(True)
    saved: list[int] = []

    def pack(t):
        saved.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        work = mask_padded_vocab_(x * 1.0, vocab, None)
        loss = vocab_parallel_cross_entropy(work, target % vocab).mean()
    assert torch.isneginf(work[..., vocab:]).all()
    n = logits.numel()
    assert max(saved) == 4 * n and sum(saved) < 4 * n + 8 * 4 * 10  # + targets, mask: [b, s]-sized only
    loss.backward()
    assert x.grad.dtype == torch.bfloat16 and not x.grad[..., vocab:].any()  # no gradient into padding
    y = logits[..., :vocab].float().requires_grad_(True)
    F.cross_entropy(y.flatten(0, 1), (target % vocab).flatten()).backward()
    torch.testing.assert_close(x.grad[..., :vocab].float(), y.grad, rtol=1e-2, atol=1e-3)


def test_cross_entropy_second_backward():
    """A second pass after the in-place backward fails loudly; ``inplace_backward=False`` allows it."""
    logits, target = _logits()
    x = logits.clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(x * 1.0, target).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):  # autograd's check
        loss.backward()
    x2 = logits.clone().requires_grad_(True)
    loss2 = vocab_parallel_cross_entropy(x2 * 1.0, target, inplace_backward=False).sum()
    (first,) = torch.autograd.grad(loss2, x2, retain_graph=True)
    (second,) = torch.autograd.grad(loss2, x2)
    assert torch.equal(first, second)


# ------------------------------------------------------------------------------------ RNG tracker


def test_rng_tracker_add_touches_no_other_generator():
    torch.manual_seed(1)
    before = torch.get_rng_state()
    tracker = tp_random.RNGStatesTracker("cpu")
    tracker.add("stream", 1234)
    assert torch.equal(torch.get_rng_state(), before)  # the default generator is untouched
    torch.manual_seed(1234)
    assert torch.equal(tracker.states["stream"], torch.get_rng_state())  # and the stream is seed 1234's


# ---------------------------------------------------------------------- host syncs in the steady state


def _called_from_ptdp() -> bool:
    """Whether the tensor method was called by ptdp's own code (two frames up: ptdp -> patch -> here)."""
    return f"{Path('ptdp').as_posix()}/" in sys._getframe(2).f_code.co_filename.replace("\\", "/")


class SyncCounter:
    """Counts what would make the host wait for a GPU when ptdp's code calls it: ``.item()``,
    ``float()``/``int()``/``bool()`` of a tensor, ``.tolist()``, and ``.to()`` from pageable host memory to
    another device (pinned ``non_blocking`` copies are fine). On the CPU nothing waits, but ptdp makes the
    same calls as on a GPU. torch's own CPU AdamW reads its CPU-resident step counter (``.item()``), which
    is no device sync and on a GPU is the fused kernel's business: calls from torch are not counted."""

    NAMES = ("item", "__float__", "__int__", "__bool__", "tolist")

    def __init__(self, monkeypatch):
        self.active = False
        self.calls: list[str] = []
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)

            def counted(t, *a, _original=original, _name=name, **k):
                if self.active and _called_from_ptdp():
                    self.calls.append(_name)
                return _original(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)
        original_to = torch.Tensor.to

        def to(t, *a, **k):
            out = original_to(t, *a, **k)
            if self.active and out.device != t.device and t.device.type == "cpu" and not (
                    t.is_pinned() and k.get("non_blocking")) and _called_from_ptdp():
                self.calls.append("pageable .to()")
            return out

        monkeypatch.setattr(torch.Tensor, "to", to)


def _run_counting(monkeypatch, tmp_path: Path, log_interval: int, iters: int = 6):
    """Train TINY in this process, counting device reads in iterations 2..``iters``: (records, calls in
    ``train_step``, calls in the whole steady-state loop)."""
    import ptdp.train.loop as training
    import ptdp.train.steppers as steppers

    counter = SyncCounter(monkeypatch)
    in_step: list[str] = []
    original_step = steppers.train_step

    def train_step(trainer, iteration):
        counter.active = iteration >= 2
        before = len(counter.calls)
        try:
            return original_step(trainer, iteration)
        finally:
            in_step.extend(counter.calls[before:])

    monkeypatch.setattr(steppers, "train_step", train_step)
    original_finish = training.CheckpointManager.finish

    def finish(self, last_iteration):  # the end-of-run save is outside the steady state
        counter.active = False
        return original_finish(self, last_iteration)

    monkeypatch.setattr(training.CheckpointManager, "finish", finish)
    args = [*TINY, "--train-iters", str(iters), "--log-interval", str(log_interval),
            "--metrics-file", str(tmp_path / "m.jsonl"), "--save", str(tmp_path / "ckpt"), "--save-interval", "100"]
    try:
        records = training.train(validated_config(args))
    finally:
        counter.active = False
    return records, in_step, counter.calls


def test_steady_state_iterations_do_not_wait_for_the_device(monkeypatch, tmp_path):
    """Iterations 2..6 of a one-process run: nothing in ``train_step`` (schedule, grad sync, clipping,
    AdamW, checkpoint checks) reads a device value, and the loop reads them with one ``tolist`` per logged
    iteration (the straggler and memory reports share one gather, which one process skips); records read
    in batches (``--log-interval 3``) equal those read every iteration."""
    iters, runs = 6, {}
    for log_interval in (1, 3):
        records, in_step, calls = _run_counting(monkeypatch, tmp_path / str(log_interval), log_interval, iters)
        assert in_step == [], in_step
        logged = sum(1 for i in range(2, iters + 1) if i % log_interval == 0 or i == iters)
        # per flush, after the step: one read of the records (the per-rank reports gather nothing alone)
        assert calls == ["tolist"] * logged, calls
        lines = (tmp_path / str(log_interval) / "m.jsonl").read_text().splitlines()
        assert [json.loads(line)["iteration"] for line in lines] == list(range(1, iters + 1))
        runs[log_interval] = [(r["loss"], r["grad_norm"]) for r in records]
    assert runs[1] == runs[3]
    # The checkpoint's generator states name their device type (a CUDA state is another size).
    import torch.distributed.checkpoint as dcp

    (directory,) = Path(tmp_path / "3" / "ckpt").glob("iter_*")
    keys = set(dcp.FileSystemReader(directory).read_metadata().state_dict_metadata)
    assert {"rng.rank0.cpu.default", "rng.rank0.cpu.model-parallel-rng"} <= keys
    assert not any(k.startswith("rng.rank0.cuda") for k in keys)
