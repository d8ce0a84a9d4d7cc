"""GPU readiness on the CPU: what keeps the steady-state loop off the GPU's queue and the watchdog quiet.

The GPU tier (tests/gpu/test_gpu.py, ``pytest -m gpu``) counts real synchronisations with
``torch.cuda.set_sync_debug_mode("error")``; these tests check the same design where a CPU can: the
per-iteration agreement (SIGTERM, NaN) never makes a tensor on the model's device, and the hang watchdog is
armed only after the first iteration (which holds the lazy ``torch.compile``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import spawn

from ptdp.train.controller import NonFiniteLossError, RunController


def _controller(rank: int, world_size: int, device: str, distributed: bool, run_dir: str,
                hang_timeout_s: float = 300.0) -> RunController:
    return RunController(rank, world_size, torch.device(device), distributed, hang_timeout_s, Path(run_dir))


def _agree_on_a_meta_device(rank: int, world_size: int, run_dir: str) -> None:
    # A "meta" model device: any agreement tensor made there could not be all-reduced (nor read), so this
    # passes only if the agreement stays on the host, over a gloo group of its own.
    controller = _controller(rank, world_size, "meta", True, run_dir)
    try:
        assert controller._agree_group is not None
        assert controller._agree(rank == 1, False) == [True, False]
        assert controller._agree(False, rank == 0) == [False, True]
        assert controller.after_iteration(1, None) is None  # nothing signalled, loss not read: go on
        controller.sigterm = rank == 0
        assert controller.after_iteration(2, None) == "SIGTERM"  # rank 0's SIGTERM stops every rank together
        with pytest.raises(NonFiniteLossError, match=f"the loss is {'nan' if rank == 1 else 'not finite'} at it"):
            controller.after_iteration(3, float("nan") if rank == 1 else 1.0)  # rank 1's NaN stops both
    finally:
        controller.close()


def test_agreement_never_touches_the_model_device(tmp_path):
    spawn(_agree_on_a_meta_device, 2, tmp_path, str(tmp_path))


def test_watchdog_is_armed_after_the_first_iteration(tmp_path):
    """The first iteration (lazy compile, NCCL communicators) is not watched; from the second on it is."""
    controller = _controller(0, 2, "cpu", False, str(tmp_path))
    try:
        controller.before_iteration(5)  # a resumed run: its first iteration is 5
        assert controller.watchdog is None
        controller.before_iteration(6)
        assert controller.watchdog is not None and (tmp_path / "hang").is_dir()
    finally:
        controller.close()
    assert not (tmp_path / "hang").exists()  # a run that ends leaves no heartbeat


# ------------------------------------------------------------------------------------------- the GPU tier


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU tier)")
def test_ring_blocks_never_materialise_scores_on_gpu():
    """CP memory: a ring block on FlashAttention-2 allocates O(s/c) per rank, where explicit math would
    allocate the (s/c)² scores (here 16 heads x 8192² fp32 = 4 GiB)."""
    from ptdp.parallel.context.attention import block_backward, block_forward, block_kernel

    q, k, v, do = (torch.randn(1, 16, 8192, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    assert block_kernel(q) == "cuda-flash"
    inputs = 4 * q.numel() * q.element_size()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, lse = block_forward(q, k, v, 0.125, True)
    block_backward(do, q, k, v, out.float(), lse, 0.125, True)
    torch.cuda.synchronize()
    # outputs, gradients and the kernels' fp32 workspaces: a few times the inputs; the fp32 scores alone
    # would be 16 x 8192² x 4 bytes = 64x the inputs
    assert torch.cuda.max_memory_allocated() - base < 8 * inputs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU tier)")
def test_offloaded_adam_state_leaves_the_gpu_and_tracks_fused_adamw():
    """Offload on a GPU: the Adam moments are host tensors, the device holds none, and the parameters follow
    the on-device fused AdamW to its rounding."""
    from ptdp.optim.offload import HostOffloadAdamW

    def params():
        g = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(1024, 1024, generator=g).cuda())]

    ref, off = params(), params()
    a = torch.optim.AdamW(ref, lr=1e-3, fused=True)
    b = HostOffloadAdamW(off, lr=1e-3)
    for step in range(3):
        grad = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(step)).cuda()
        ref[0].grad, off[0].grad = grad, grad.clone()
        a.step()
        before = torch.cuda.memory_allocated()
        b.step()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before  # no device memory for the state
    assert b.state[off[0]]["exp_avg"].device.type == "cpu"
    torch.testing.assert_close(off[0], ref[0], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU of compute capability >= 8.9 (FP8)")
def test_fp8_training_tracks_bf16_on_gpu(tmp_path):
    """Real FP8 GEMMs (torchao, hybrid and e4m3) train the tiny-but-FP8-shaped GPT within 2% of bf16."""
    pytest.importorskip("torchao")
    from helpers import TINY, losses, train_metrics

    shape = ["--hidden-size", "64", "--train-iters", "20", "--lr", "1e-3"]
    bf16 = train_metrics(tmp_path / "bf16", 1, [*shape, "--bf16"], TINY)
    for fmt in ("hybrid", "e4m3"):
        fp8 = train_metrics(tmp_path / fmt, 1, [*shape, "--bf16", "--fp8-format", fmt], TINY)
        assert losses(fp8) == pytest.approx(losses(bf16), rel=2e-2)
