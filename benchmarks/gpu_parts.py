"""The parts of ``benchmarks/gpu_suite.py``: each measures one thing on the GPU, or at toy size on
the CPU (``ctx.dry_run``), and reports through ``ctx.emit`` as it goes, so a part stopped by its time budget
still leaves what it had measured. A part raises :class:`Skipped` when this machine cannot run it (FP8 needs
compute capability >= 8.9 and torchao) and :class:`NotBuilt` when the feature does not exist yet.

The training measurements are ``benchmarks/gpu.py``'s :func:`gpu.measure` (ptdp's step against a plain PyTorch
loop of the same model), the grouped-GEMM one ``benchmarks/moe.py``'s ``bench_experts``; what is new here is
the single-GPU correctness checks (:func:`zero3_layer_gather`, :func:`cp_flash_attention`), which the GPU tests
(``tests/gpu/test_gpu_features.py``) assert on as well.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


class Skipped(Exception):
    """This machine cannot run the part (the message says why, in one line)."""


class NotBuilt(Exception):
    """The feature the part measures does not exist in ptdp yet."""


@dataclass
class PartContext:
    dry_run: bool
    emit: Callable[..., None]

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"


# ------------------------------------------------------------------------- training: benchmarks/gpu.py

TOY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--groups", "2", "--ffn", "128", "--seq", "32",
       "--vocab", "300", "--micro-batch-size", "2", "--microbatches", "1", "--iters", "1", "--repeats", "1",
       "--warmup", "1", "--no-compile", "--device", "cpu"]


def _gpu_args(ctx: PartContext, flags: list[str]) -> argparse.Namespace:
    import gpu

    return gpu.build_parser().parse_args([*flags, *(TOY if ctx.dry_run else [])])


def _measure(ctx: PartContext, flags: list[str], name: str) -> dict:
    """``gpu.measure`` with ``flags``; emits ptdp's figures as soon as they exist (before the plain loop)."""
    import gpu

    out = gpu.measure(_gpu_args(ctx, flags), report=lambda ptdp: ctx.emit(**{f"{name}_ptdp": _brief(ptdp)}))
    ctx.emit(**{f"{name}_ptdp": _brief(out["ptdp"]), f"{name}_model": out["model"]})
    return out


def _brief(r: dict | None) -> dict | None:
    keys = ("iteration_s", "tokens_per_s", "tflops_per_gpu", "mfu", "peak_memory_gib", "final_loss", "params")
    return None if r is None else {k: r.get(k) for k in keys}


def _training(ctx: PartContext, model: str) -> None:
    out = _measure(ctx, ["--model", model, "--warmup", "2", "--iters", "4", "--repeats", "2"], "run")
    ctx.emit(mfu=out["mfu"], time_over_plain_pytorch=out["time_over_plain_pytorch"],
             tokens_per_s=out["tokens_per_s"], peak_memory_gib=out["peak_memory_gib"],
             plain_pytorch=_brief(out["plain_pytorch"]), plan_estimate=out["plan_estimate"],
             device=out["device"], goals={"mfu": 0.55, "time_over_plain_pytorch": 1.02})


def part_gpt_1p3b(ctx: PartContext) -> None:
    """The GPT-3 1.3B shape, bf16, compiled: MFU, time over plain PyTorch, peak memory of both."""
    _training(ctx, "gpt-1.3b")


def part_llama_1b(ctx: PartContext) -> None:
    """Llama 3.2 1B's shape (GQA, SwiGLU, RoPE, RMSNorm, tied), against ``overhead.PlainLlama``."""
    _training(ctx, "llama-1b")


def tail_mean(curve: list[float]) -> float:
    k = max(1, len(curve) // 10)
    return sum(curve[-k:]) / k


FP8_SHAPE = ["--layers", "4", "--hidden", "2048", "--heads", "16", "--seq", "1024", "--vocab", "50257",
             "--micro-batch-size", "8", "--microbatches", "1", "--warmup", "2", "--iters", "10", "--repeats", "1",
             "--skip-plain"]


def part_fp8(ctx: PartContext) -> None:
    """bf16 against FP8 (torchao, hybrid, tensorwise) on a small GPT: tokens/s, and the relative gap of the
    two loss curves' last-10% means after 200 iterations from the same start (goals >= 1.25, <= 0.01)."""
    curve = ["--loss-curve", "3" if ctx.dry_run else "200"]
    patch = contextlib.nullcontext()
    if ctx.dry_run:  # torchao's casts with high-precision GEMMs: the code path, not the speed
        import functools

        from ptdp.parallel import fp8

        patch = _patched(fp8, "enable_fp8", functools.partial(fp8.enable_fp8, emulate=True))
    else:
        _require_fp8()
    bf16 = _measure(ctx, [*FP8_SHAPE, *curve], "bf16")
    with patch:
        fp8_run = _measure(ctx, [*FP8_SHAPE, *curve, "--fp8-format", "hybrid"], "fp8")
    b, f = tail_mean(bf16["ptdp"]["loss_curve"]), tail_mean(fp8_run["ptdp"]["loss_curve"])
    ctx.emit(fp8_tokens_per_s_over_bf16=fp8_run["tokens_per_s"] / bf16["tokens_per_s"], fp8_loss_gap=abs(f - b) / b,
             bf16_tail_loss=b, fp8_tail_loss=f, iterations=len(bf16["ptdp"]["loss_curve"]),
             goals={"fp8_tokens_per_s_over_bf16": 1.25, "fp8_loss_gap": 0.01})


def _require_fp8() -> None:
    from ptdp.config import Config
    from ptdp.parallel.fp8 import fp8_environment_errors

    config = Config()
    config.precision.fp8_format, config.precision.bf16 = "hybrid", True
    errors = fp8_environment_errors(config)
    if errors:
        raise Skipped(errors[0])


@contextlib.contextmanager
def _patched(module, name: str, value):
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


OFFLOAD_SHAPE = ["--layers", "24", "--hidden", "1024", "--heads", "16", "--seq", "1024", "--vocab", "50257",
                 "--micro-batch-size", "8", "--microbatches", "1", "--warmup", "1", "--iters", "3", "--repeats", "1",
                 "--skip-plain", "--no-compile"]


def _gib(x: float | None, y: float | None) -> float | None:
    return None if x is None or y is None else x - y


def part_optimizer_offload(ctx: PartContext) -> None:
    """``--optimizer-cpu-offload`` on a 350M GPT: peak memory saved (formula: the two fp32 Adam moments,
    8 bytes per parameter) and iteration time over on-device AdamW."""
    base = _measure(ctx, OFFLOAD_SHAPE, "device_adam")
    off = _measure(ctx, [*OFFLOAD_SHAPE, "--optimizer-cpu-offload"], "host_adam")
    params = base["ptdp"]["params"]
    ctx.emit(memory_saved_gib=_gib(base["peak_memory_gib"], off["peak_memory_gib"]),
             formula_gib=8 * params / 2**30, time_ratio=off["ptdp"]["iteration_s"] / base["ptdp"]["iteration_s"])


ACTIVATION_SHAPE = ["--layers", "8", "--hidden", "2048", "--heads", "16", "--seq", "2048", "--vocab", "50257",
                    "--micro-batch-size", "8", "--microbatches", "1", "--warmup", "1", "--iters", "3", "--repeats", "1",
                    "--skip-plain", "--no-compile", "--recompute-granularity", "full"]


def part_activation_offload(ctx: PartContext) -> None:
    """ZeRO-R's CPU checkpointing (``--checkpoint-in-cpu``) under full recomputation: peak memory saved
    (formula: every unit's kept input but the one being recomputed, L·s·b·h·2 bytes in bf16, one microbatch
    in flight) and iteration time over keeping them on the GPU. On the CPU ptdp refuses the flag."""
    base = _measure(ctx, ACTIVATION_SHAPE, "on_device")
    m = base["model"]
    ctx.emit(formula_gib=m["layers"] * m["seq"] * m["micro_batch_size"] * m["hidden"] * 2 / 2**30)
    if ctx.dry_run:
        from ptdp.config import Config
        from ptdp.parallel.recompute import recompute_environment_errors

        config = Config()
        config.model.recompute_granularity, config.model.checkpoint_in_cpu = "full", True
        ctx.emit(memory_saved_gib=None, time_ratio=None, note=(recompute_environment_errors(config) or ["GPU"])[0])
        return
    off = _measure(ctx, [*ACTIVATION_SHAPE, "--checkpoint-in-cpu"], "in_cpu")
    ctx.emit(memory_saved_gib=_gib(base["peak_memory_gib"], off["peak_memory_gib"]),
             time_ratio=off["ptdp"]["iteration_s"] / base["ptdp"]["iteration_s"],
             loss_same=off["ptdp"]["final_loss"] == base["ptdp"]["final_loss"])


# ------------------------------------------------------------------------------------ kernels, one GPU


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def part_moe_grouped_gemm(ctx: PartContext) -> None:
    """The MoE expert MLPs (SwiGLU, uneven routing) by one grouped GEMM against a loop over the experts,
    forward + backward: ``loop_over_grouped`` (> 1: grouped is faster), at 8 large and 64 small experts."""
    import moe

    for name, (e, h, f, tokens) in {"e8": (8, 2048, 1408, 8192), "e64": (64, 1024, 512, 8192)}.items():
        if ctx.dry_run:
            e, h, f, tokens = e // 4, 32, 64, 64
        args = argparse.Namespace(device=ctx.device, dtype="float32" if ctx.dry_run else "bfloat16", experts=e,
                                  topk=2, hidden=h, expert_ffn=f, tokens=tokens, warmup=1 if ctx.dry_run else 3,
                                  repeats=1 if ctx.dry_run else 10)
        ctx.emit(**{name: moe.bench_experts(args)})


def cp_flash_attention(device: str, shape: tuple[int, int, int, int], dtype: torch.dtype, repeats: int) -> dict:
    """Context parallelism's block kernels at c = 1 (one causal diagonal block, forward + backward): the flash
    path ``block_kernel`` picks against the explicit math fallback, on the same inputs. Time and peak memory
    above the inputs of each, and the largest difference of their outputs and gradients."""
    from ptdp.parallel.context import attention

    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(shape, device=device, dtype=dtype, generator=g) for _ in range(4))
    scale = q.shape[-1] ** -0.5
    out: dict = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "kernel": attention.block_kernel(q)}
    results = {}
    for path in ("flash", "math"):
        patch = _patched(attention, "block_kernel", lambda _q: "math") if path == "math" else contextlib.nullcontext()
        with patch:
            def one() -> tuple:
                o, lse = attention.block_forward(q, k, v, scale, True)
                return (o, lse, *attention.block_backward(do, q, k, v, o.float(), lse, scale, True))

            results[path] = one()
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            seconds = _median_seconds(one, repeats)
            peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else None
        out[path] = {"seconds": seconds, "peak_bytes_above_inputs": peak}
    diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(results["flash"], results["math"], strict=True)]
    out["max_abs_diff"] = max(diffs)
    out["math_over_flash_time"] = out["math"]["seconds"] / out["flash"]["seconds"]
    b, h, s, _ = shape
    out["scores_bytes_formula"] = b * h * s * s * torch.finfo(dtype).bits // 8  # what math materialises
    if device == "cuda":
        out["math_over_flash_memory"] = out["math"]["peak_bytes_above_inputs"] / out["flash"]["peak_bytes_above_inputs"]
    return out


def part_cp_flash_attention(ctx: PartContext) -> None:
    shape = (1, 2, 64, 16) if ctx.dry_run else (1, 16, 8192, 128)
    ctx.emit(**cp_flash_attention(ctx.device, shape, torch.float32 if ctx.dry_run else torch.bfloat16,
                                  1 if ctx.dry_run else 5))


def zero3_layer_gather(device: str, hidden: int = 64, layers: int = 4, seq: int = 32) -> dict:
    """ZeRO-3's per-layer gather path (``LayerParamSync``, prefetch on) over a data-parallel group of one:
    every bucket's parameters freed, gathered back per layer and freed again, on ``device``. Two microbatches
    of forward + backward, full recomputation on; the gradients against the same model run plainly (no
    buckets), and how many layers were ever whole at once. Needs a default process group of one rank."""
    import torch.distributed as dist

    from ptdp.config import ModelConfig
    from ptdp.models import GPTModel
    from ptdp.parallel.data.buffer import BucketLayout, FlatBuffer
    from ptdp.parallel.data.zero import OptimGradsParams
    from ptdp.parallel.data.zero_layers import LayerParamSync
    from ptdp.parallel.init import init_parameters
    from ptdp.parallel.parallelize import parallelize
    from ptdp.parallel.placement import Placements
    from ptdp.parallel.tensor import language_model_loss

    cfg = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=4, seq_length=seq,
                      hidden_dropout=0.0, attention_dropout=0.0, recompute_granularity="full")
    data = torch.randint(0, 100, (2, 2, seq + 1), generator=torch.Generator().manual_seed(0)).to(device)

    def model() -> tuple[GPTModel, Placements]:
        placements = Placements()
        with torch.device(device):
            m = parallelize(GPTModel(cfg, 100, 128), placements)
        init_parameters(m, seed=7, std=0.02, num_layers=layers, placements=placements)
        return m, placements

    def backward(m: GPTModel) -> None:
        for tokens in data:
            language_model_loss(m(tokens[:, :-1]), tokens[:, 1:]).backward()

    reference, _ = model()
    backward(reference)
    want = {id(p): p.grad for p in reference.parameters()}
    ours, ours_placements = model()
    order = {id(p): q for p, q in zip(ours.parameters(), reference.parameters(), strict=True)}
    # ZeRO-3's reducer itself over the group of one (build_reducer would choose no_shard for one rank)
    layout = BucketLayout(4 * hidden * hidden * 4, param_buffer=True, placements=ours_placements)
    storage = OptimGradsParams.storage(dist.group.WORLD, hybrid=False)
    grads = OptimGradsParams(FlatBuffer(list(ours.parameters()), layout, storage), dist.group.WORLD)
    total = sum(b.param_data.numel() * b.param_data.element_size() for b in grads.buckets)
    sync = LayerParamSync(grads, list(ours.layers.values()), prefetch=True)
    grads.start_iteration(len(data))
    sync.gather(0)
    sync.wait(0)
    backward(ours)
    sync.reduce_grads(0)
    sync.release(0)
    grads.finish_grad_sync()
    diff = 0.0
    for b in grads.buckets:
        for p, offset in zip(b.params, b.offsets, strict=True):
            got = b.own_grad[offset:offset + p.numel()].view_as(p)  # one rank: its shard is the bucket
            diff = max(diff, (got - want[id(order[id(p)])]).abs().max().item())
    left = sum(b.param_data.untyped_storage().nbytes() for b in grads.buckets)
    return {"max_abs_grad_diff": diff, "peak_layers_whole": sync.peak_layers, "buckets": len(grads.buckets),
            "param_bytes_whole_after_step": left, "param_bytes_total": total}


def part_zero3_layer_gather(ctx: PartContext) -> None:
    import torch.distributed as dist

    dist.init_process_group("nccl" if ctx.device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    if ctx.device == "cuda":
        torch.cuda.set_device(0)
    try:
        ctx.emit(**zero3_layer_gather(ctx.device, *((64, 4, 32) if ctx.dry_run else (1024, 8, 512))))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------- not built yet

DOCUMENT_ATTENTION = [("ptdp.ops.document_attention", "document_attention"),
                      ("ptdp.ops.attention", "document_attention"), ("ptdp.ops.packed", "document_attention")]


def find_document_attention() -> Callable | None:
    """The packed-document ``document_attention(q, k, v, cu_seqlens)`` (causal within each document of a packed
    sequence, ``cu_seqlens`` the cumulative lengths), wherever the packing work puts it; None until then."""
    for module, name in DOCUMENT_ATTENTION:
        try:
            fn = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if fn is not None:
            return fn
    return None


def part_document_masking(ctx: PartContext) -> None:
    """Document-masked attention against full causal attention at s = 4096, documents of mean length 384:
    time of forward + backward of each (goal: roughly the ratio of computed blocks)."""
    fn = find_document_attention()
    if fn is None:
        raise NotBuilt("document-masked attention is not in ptdp yet: looked for "
                       + ", ".join(f"{m}.{n}" for m, n in DOCUMENT_ATTENTION))
    import torch.nn.functional as F

    s, heads, d = (256, 2, 16) if ctx.dry_run else (4096, 16, 128)
    dtype = torch.float32 if ctx.dry_run else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    lengths = (torch.rand(64, generator=g) * 512 + 128).long().cumsum(0) * s // 8192
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths[lengths < s], torch.tensor([s])]).to(ctx.device)
    q, k, v = (torch.randn(1, heads, s, d, device=ctx.device, dtype=dtype, requires_grad=True) for _ in range(3))
    full = _median_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward(), 3)
    docs = _median_seconds(lambda: fn(q, k, v, cu).sum().backward(), 3)
    computed = sum(int(n) * (int(n) + 1) // 2 for n in cu.diff()) / (s * (s + 1) // 2)
    ctx.emit(full_causal_s=full, document_s=docs, document_over_full=docs / full, computed_fraction=computed,
             documents=len(cu) - 1)


PARTS: dict[str, tuple[Callable[[PartContext], None], float, tuple[str, ...]]] = {
    # name: (function, budget on one H100 in seconds, keys the result must hold when the part ran)
    "gpt_1p3b": (part_gpt_1p3b, 65, ("mfu", "time_over_plain_pytorch", "tokens_per_s", "peak_memory_gib",
                                    "plain_pytorch")),
    "llama_1b": (part_llama_1b, 50, ("mfu", "time_over_plain_pytorch", "tokens_per_s", "peak_memory_gib",
                                    "plain_pytorch")),
    "fp8": (part_fp8, 40, ("fp8_tokens_per_s_over_bf16", "fp8_loss_gap")),
    "moe_grouped_gemm": (part_moe_grouped_gemm, 10, ("e8", "e64")),
    "cp_flash_attention": (part_cp_flash_attention, 10, ("flash", "math", "max_abs_diff", "math_over_flash_time")),
    "zero3_layer_gather": (part_zero3_layer_gather, 15, ("max_abs_grad_diff", "peak_layers_whole")),
    "optimizer_offload": (part_optimizer_offload, 20, ("memory_saved_gib", "formula_gib", "time_ratio")),
    "activation_offload": (part_activation_offload, 20, ("memory_saved_gib", "formula_gib", "time_ratio")),
    "document_masking": (part_document_masking, 5, ("document_over_full", "computed_fraction")),
}
