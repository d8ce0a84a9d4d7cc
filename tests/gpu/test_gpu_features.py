"""The GPU tier for what came after the last GPU run: each feature's single-GPU code path on CUDA
against the same computation on the CPU, and no host sync in its steady state.

On one GPU the multi-rank parallelisms (vocabulary, expert, context, ZeRO over d > 1) cannot run, so what
is tested is their single-rank code: the MoE grouped GEMM, FP8 GEMMs, the optimizer on the host, ZeRO-R's
``--checkpoint-in-cpu``, context parallelism's flash block kernels at c = 1, ZeRO-3's per-layer gathers over
a group of one. Every test needs a CUDA device and is skipped without one (``pytest -m gpu``); the helpers
they share with ``benchmarks/gpu_suite.py`` also run on the CPU in its dry run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import TINY, assert_same_run, train_metrics, validated_config

from ptdp.config import ModelConfig, MoEConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU tier)")]

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-grouped-gemm"]
ITERS = ["--train-iters", "3"]


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, in fp32 on the CPU: the yardstick for bf16 against fp32."""
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


def cuda_train(flags: list[str]) -> list[dict]:
    """``ptdp train`` in this process, on the GPU (``train`` picks the device itself)."""
    from ptdp.train.loop import train

    return train(validated_config([*TINY, *flags]))


@pytest.fixture(scope="module")
def cpu_reference(tmp_path_factory) -> dict[str, list[dict]]:
    """The CPU runs every CUDA run below is compared with (one subprocess each: the device is the CPU)."""
    tmp = tmp_path_factory.mktemp("cpu")
    return {"dense": train_metrics(tmp, 1, ITERS, env=CPU_ONLY),
            "moe-bf16": train_metrics(tmp, 1, [*ITERS, *MOE, "--bf16"], env=CPU_ONLY)}


# ------------------------------------------------------------------------ one training step, CUDA vs CPU


@pytest.mark.parametrize("flags", [[], ["--optimizer-cpu-offload"],
                                   ["--recompute-granularity", "full", "--checkpoint-in-cpu"]],
                         ids=["dense", "optimizer-cpu-offload", "checkpoint-in-cpu"])
def test_training_on_cuda_equals_cpu_fp32(cpu_reference, flags):
    """fp32: losses and gradient norms of 3 iterations within CPU/CUDA summation-order tolerance."""
    assert_same_run(cuda_train([*ITERS, *flags]), cpu_reference["dense"], 1e-4)


def test_moe_grouped_gemm_training_on_cuda_tracks_cpu_bf16(cpu_reference):
    """bf16 MoE with the grouped GEMM (one ``torch._grouped_mm`` per projection on the GPU): within bf16
    tolerance of the CPU's run (CPU kernels sum in another order and round at other points)."""
    got, want = cuda_train([*ITERS, *MOE, "--bf16"]), cpu_reference["moe-bf16"]
    for a, b in zip(got, want, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=5e-2)


def test_grouped_experts_on_cuda_equal_the_cpu_loop():
    """The expert MLPs (SwiGLU, uneven routing, one expert without tokens) by the bf16 grouped GEMM on the
    GPU against the fp32 loop over experts on the CPU, from the same weights: outputs and every gradient."""
    from ptdp.models import GroupedExperts
    from ptdp.ops.grouped import grouped_mm_available

    if not grouped_mm_available(torch.device("cuda"), torch.bfloat16):
        pytest.skip("torch._grouped_mm does not run in bf16 on this GPU")
    cfg = ModelConfig(hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, swiglu=True)
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([40, 0, 7, 81])
    x = torch.randn(int(counts.sum()), 64, generator=g)
    results = {}
    for device, dtype, grouped in (("cpu", torch.float32, False), ("cuda", torch.bfloat16, True)):
        experts = GroupedExperts(cfg, MoEConfig(num_experts=4, moe_grouped_gemm=grouped))
        torch.manual_seed(1)
        for p in experts.parameters():
            torch.nn.init.normal_(p, std=0.05)
        experts = experts.to(device, dtype)
        xi = x.to(device, dtype).detach().requires_grad_(True)  # a leaf of its own on each device
        out = experts(xi, counts.to(device))
        out.float().square().sum().backward()
        results[device] = [out, xi.grad, *(p.grad for p in experts.parameters())]
    for got, want in zip(results["cuda"], results["cpu"], strict=True):
        assert rel_error(got, want) < 2e-2
    assert results["cuda"][2][1].abs().max() == 0  # the expert without tokens gets a zero gradient


def test_fp8_step_on_cuda_tracks_the_emulated_step_on_cpu():
    """Real FP8 GEMMs (torchao, hybrid, tensorwise) against torchao's emulation (the same casts, high-precision
    GEMMs) on the CPU: loss and gradients of one step from the same bf16 weights."""
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability >= 8.9")
    from ptdp.models import GPTModel
    from ptdp.parallel.fp8 import enable_fp8
    from ptdp.parallel.init import init_parameters
    from ptdp.parallel.parallelize import parallelize
    from ptdp.parallel.tensor import language_model_loss

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, hidden_dropout=0.0,
                      attention_dropout=0.0)
    tokens = torch.randint(0, 200, (4, 33), generator=torch.Generator().manual_seed(0))
    results = {}
    for device in ("cpu", "cuda"):
        with torch.device(device):
            model = parallelize(GPTModel(cfg, 200, 256))  # the layers FP8 switches are the parallel linears
        init_parameters(model, 1234, 0, 1, cfg.init_method_std, cfg.num_layers)
        model.to(torch.bfloat16)
        assert enable_fp8([model], "hybrid", "tensorwise", emulate=device == "cpu")
        t = tokens.to(device)
        loss = language_model_loss(model(t[:, :-1]), t[:, 1:])
        loss.backward()
        results[device] = (loss, {n: p.grad for n, p in model.named_parameters()})
    assert results["cuda"][0].item() == pytest.approx(results["cpu"][0].item(), rel=1e-2)
    for name, grad in results["cpu"][1].items():
        assert rel_error(results["cuda"][1][name], grad) < 5e-2, name


def test_checkpoint_in_cpu_keeps_the_inputs_off_the_gpu_and_replays_dropout():
    """ZeRO-R's CPU checkpointing under full recomputation, dropout on: the same gradients as keeping the
    inputs on the GPU (the recompute replays the GPU generator's masks), and after the forward the GPU holds
    the 4 units' inputs fewer (s·b·h fp32 each)."""
    from ptdp.models import GPTModel
    from ptdp.parallel.init import init_parameters
    from ptdp.parallel.parallelize import parallelize
    from ptdp.parallel.tensor import language_model_loss, model_parallel_seed

    s, b, h = 128, 4, 256
    tokens = torch.randint(0, 200, (b, s + 1), generator=torch.Generator().manual_seed(0)).cuda()
    results = {}
    for offload in (False, True):
        cfg = ModelConfig(num_layers=4, hidden_size=h, num_attention_heads=4, seq_length=s, hidden_dropout=0.1,
                          attention_dropout=0.1, recompute_granularity="full", checkpoint_in_cpu=offload)
        with torch.device("cuda"):
            model = parallelize(GPTModel(cfg, 200, 256))
        init_parameters(model, 1234, 0, 1, cfg.init_method_std, cfg.num_layers)
        model_parallel_seed(1234, 0, 0, torch.device("cuda"))
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = language_model_loss(model(tokens[:, :-1]), tokens[:, 1:])
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # the allocator frees the blocks whose side-stream copies are done
        held = torch.cuda.memory_allocated() - before
        loss.backward()
        results[offload] = (held, loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert results[True][1] == pytest.approx(results[False][1], rel=1e-6)
    for name, grad in results[False][2].items():  # the same kernels; only atomics may reorder a sum
        torch.testing.assert_close(results[True][2][name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert results[False][0] - results[True][0] >= 0.9 * 4 * s * b * h * 4, (results[False][0], results[True][0])


# -------------------------------------------------------------------------------- single-rank kernels


def test_cp_flash_block_kernels_on_cuda_equal_the_cpu():
    """Context parallelism's ring block at c = 1 (one causal diagonal block) on FlashAttention-2 in bf16
    against the CPU's kernel in fp32 on the same (bf16-rounded) inputs: output, LSE and the three gradients."""
    from ptdp.parallel.context.attention import block_backward, block_forward, block_kernel

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 4, 256, 64, generator=g).bfloat16() for _ in range(4))
    results = {}
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
        qd, kd, vd, dod = (t.to(device, dtype) for t in (q, k, v, do))
        assert block_kernel(qd) == ("cuda-flash" if device == "cuda" else "cpu-flash")
        out, lse = block_forward(qd, kd, vd, 0.125, True)
        results[device] = (out, lse, *block_backward(dod, qd, kd, vd, out.float(), lse, 0.125, True))
    for got, want in zip(results["cuda"], results["cpu"], strict=True):
        assert rel_error(got, want) < 2e-2


def test_cp_flash_block_against_math_on_cuda():
    """The suite's measurement at a small size: flash and math agree, and math holds the s² scores."""
    from gpu_parts import cp_flash_attention

    out = cp_flash_attention("cuda", (1, 8, 2048, 64), torch.bfloat16, repeats=1)
    assert out["kernel"] == "cuda-flash" and out["max_abs_diff"] < 5e-2
    assert out["math"]["peak_bytes_above_inputs"] >= out["scores_bytes_formula"]
    assert out["flash"]["peak_bytes_above_inputs"] < out["scores_bytes_formula"] / 4


@pytest.fixture
def group_of_one():
    """A default process group of this one process (NCCL), for code that takes a data-parallel group."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_zero3_per_layer_gathers_over_a_group_of_one_on_cuda(group_of_one):
    """ZeRO-3's per-layer path on the GPU: every bucket freed and gathered back layer by layer (prefetch on,
    full recomputation), the gradients the plain model's, at most two layers whole, all freed after."""
    from gpu_parts import zero3_layer_gather

    out = zero3_layer_gather("cuda", hidden=256, layers=4, seq=128)
    assert out["max_abs_grad_diff"] <= 1e-6
    assert out["peak_layers_whole"] <= 2 and out["param_bytes_whole_after_step"] == 0


# -------------------------------------------------------------------------------------- no host sync


@pytest.mark.parametrize("extra", [[*MOE, "--bf16"], ["--bf16", "--recompute-granularity", "full", "--checkpoint-in-cpu"],
                                   ["--bf16", "--fp8-format", "hybrid"]],
                         ids=["moe-grouped-gemm", "checkpoint-in-cpu", "fp8"])
def test_steady_state_never_waits_for_the_gpu(monkeypatch, tmp_path, extra):
    """As tests/gpu/test_gpu.py's test of the same name, for the features since: from iteration 2 on, any
    host-device sync outside the logged records' read raises. (``--optimizer-cpu-offload`` is left out: its
    step waits for the gradients' copy to the host by design, ptdp/optim/offload.py.)"""
    if "--fp8-format" in extra:
        pytest.importorskip("torchao")
        if torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("FP8 GEMMs need compute capability >= 8.9")
    from test_gpu import steady_state_records

    records = steady_state_records(monkeypatch, tmp_path, extra)
    assert len(records) == 8 and all(r["loss"] == r["loss"] for r in records)
