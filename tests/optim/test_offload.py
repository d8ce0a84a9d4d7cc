"""``--optimizer-cpu-offload``: Adam's state and step on the host, exact against the on-device
optimizer. On a CPU the "device" and the host are the same memory, but the offloading optimizer still
copies every parameter and gradient into buffers of its own, steps those and copies back (the GPU code
path), so these tests check its bookkeeping; the GPU tier measures memory and time."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY, losses, train_metrics

from ptdp.optim.offload import HostOffloadAdamW, fused_adamw_on


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(8, 4, generator=g)), torch.nn.Parameter(torch.randn(4, generator=g))]


def test_host_adamw_steps_exactly_like_adamw():
    ref, off = _params(0), _params(0)
    kwargs = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
    groups = lambda ps: [{"params": ps[:1], "weight_decay": 0.1}, {"params": ps[1:], "weight_decay": 0.0}]  # noqa: E731
    on_device = torch.optim.AdamW(groups(ref), fused=fused_adamw_on("cpu") or None, **kwargs)  # as ptdp builds it
    a, b = on_device, HostOffloadAdamW(groups(off), **kwargs)
    for step in range(4):
        for i, (x, y) in enumerate(zip(ref, off, strict=True)):
            x.grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(10 * step + i))
            y.grad = x.grad.clone()
        b.param_groups[0]["lr"] = a.param_groups[0]["lr"] = 1e-2 / (step + 1)  # the loop sets lr per group
        a.step()
        b.step()
        for x, y in zip(ref, off, strict=True):
            assert torch.equal(x, y)
            assert set(b.state[y]) == set(a.state[x])  # keyed by the model's parameter, as checkpoints read it
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(a.state[x][key], b.state[y][key])
                assert b.state[y][key].device.type == "cpu"
            assert b.state[y]["exp_avg"].data_ptr() != y.data_ptr()
    assert len(b.state) == 2  # no host buffer ever became a key


@pytest.mark.parametrize("nproc,extra", [(1, []), (1, ["--bf16"]), (2, ["--use-distributed-optimizer", "--bf16"]),
                                         (2, ["--pipeline-model-parallel-size", "2"])],
                         ids=["fp32", "bf16", "d2-zero1-bf16", "p2-fp32"])
def test_offloaded_training_equals_on_device(tmp_path, nproc, extra):
    """Losses and grad norms to the bit: the host step is torch's CPU AdamW, as the on-device one here."""
    base = train_metrics(tmp_path / "base", nproc, extra, [*TINY, "--train-iters", "4"])
    offload = train_metrics(tmp_path / "offload", nproc, [*extra, "--optimizer-cpu-offload"], [*TINY, "--train-iters", "4"])
    assert losses(offload) == losses(base)
    assert [r["grad_norm"] for r in offload] == [r["grad_norm"] for r in base]


def test_offloaded_state_checkpoints_and_resumes(tmp_path):
    """Saved at iteration 2 and resumed: the same losses as a straight run (the host state round-trips)."""
    args = [*TINY, "--train-iters", "4", "--optimizer-cpu-offload", "--bf16"]
    straight = train_metrics(tmp_path / "straight", 1, [], args)
    ckpt = tmp_path / "ckpt"
    train_metrics(tmp_path / "first", 1, ["--save", str(ckpt), "--save-interval", "2", "--exit-interval", "2"], args)
    resumed = train_metrics(tmp_path / "resumed", 1, ["--load", str(ckpt)], args)
    assert losses(resumed) == losses(straight)[2:]


def test_the_flag_selects_the_host_optimizer():
    from ptdp.config import OptimizerConfig
    from ptdp.optim import eager
    from ptdp.optim.optimizer import build_optimizer

    params = _params(0)
    assert type(build_optimizer(params, OptimizerConfig())) is eager.AdamW  # torch's AdamW (ptdp.optim.eager)
    assert isinstance(build_optimizer(params, OptimizerConfig(optimizer_cpu_offload=True)), HostOffloadAdamW)
