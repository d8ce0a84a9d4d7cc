"""The GPU tier (``pytest -m gpu``): the same layers, losses and checkpoints on CUDA, and no host syncs.

Every test needs one CUDA device and is skipped without one, so ``python -m pytest`` on a CPU machine
stays green. Single process only (one GPU): unit tests run in this process, training runs as
``ptdp train`` subprocesses (which pick the GPU up by themselves; ``CUDA_VISIBLE_DEVICES=""`` makes one
train on the CPU) or in-process through ``ptdp.train.loop.train``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY, assert_same_run, losses, train_metrics, validated_config

from ptdp.config import ModelConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU tier)")]

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
FP32 = {"rtol": 1e-4, "atol": 1e-5}  # CPU and CUDA kernels sum in different orders


def _model_config(**overrides) -> ModelConfig:
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, hidden_dropout=0.0,
                      attention_dropout=0.0)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def _model(device: str, cfg: ModelConfig, vocab: int = 200):
    from ptdp.models import GPTModel
    from ptdp.parallel.init import init_parameters

    padded = cfg.padded_vocab_size(vocab, 1)
    with torch.device(device):
        model = GPTModel(cfg, vocab, padded)
    init_parameters(model, 1234, cfg.init_method_std, cfg.num_layers)
    return model


def _tokens(cfg: ModelConfig, vocab: int = 200) -> torch.Tensor:
    return torch.randint(0, vocab, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0))


def _loss_and_grads(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    from ptdp.parallel.tensor import language_model_loss

    logits = model(tokens[:, :-1])
    kept = logits.detach().float().clone()
    loss = language_model_loss(logits, tokens[:, 1:])
    loss.backward()
    return loss.detach(), kept, {n: p.grad.float() for n, p in model.named_parameters()}


# -------------------------------------------------------------------------------------- unit tests


def test_model_forward_backward_on_cuda_equals_cpu():
    """The same weights (initialisation is device-independent), logits, loss and every gradient."""
    cfg = _model_config()
    tokens = _tokens(cfg)
    cpu = _loss_and_grads(_model("cpu", cfg), tokens)
    cuda = _loss_and_grads(_model("cuda", cfg), tokens.cuda())
    torch.testing.assert_close(cuda[0].cpu(), cpu[0], **FP32)
    assert torch.isneginf(cuda[1][..., 200:]).all()  # padded vocabulary at t=1, padding masked
    torch.testing.assert_close(cuda[1][..., :200].cpu(), cpu[1][..., :200], **FP32)
    for name, grad in cpu[2].items():
        torch.testing.assert_close(cuda[2][name].cpu(), grad, **FP32, msg=name)


def test_tensor_parallel_layers_at_t1_on_cuda():
    from ptdp.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.device("cuda"):
        col, row, emb = ColumnParallelLinear(16, 24, fused=3), RowParallelLinear(24, 16), VocabParallelEmbedding(50, 16)
    for p in (*col.parameters(), *row.parameters(), *emb.parameters()):
        torch.nn.init.normal_(p, generator=g)
    x = torch.randn(2, 5, 16, device="cuda", generator=g)
    torch.testing.assert_close(col(x), F.linear(x, col.weight.flatten(0, 1), col.bias.flatten()))
    h = torch.randn(2, 5, 24, device="cuda", generator=g)
    torch.testing.assert_close(row(h), F.linear(h, row.weight, row.bias))
    ids = torch.randint(0, 50, (2, 5), device="cuda", generator=g)
    torch.testing.assert_close(emb(ids), F.embedding(ids, emb.weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_on_cuda_equals_torch(dtype):
    from ptdp.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (3 * torch.randn(4, 64, 1000, device="cuda", generator=g)).to(dtype)
    target = torch.randint(0, 1000, (4, 64), device="cuda", generator=g)
    x, y = logits.clone().requires_grad_(True), logits.float().clone().requires_grad_(True)
    ours = vocab_parallel_cross_entropy(x * 1, target)
    ours.mean().backward()
    theirs = F.cross_entropy(y.flatten(0, 1), target.flatten(), reduction="none").view(4, 64)
    theirs.mean().backward()
    tol = FP32 if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-4}
    torch.testing.assert_close(ours, theirs, **FP32)  # computed in fp32 from the same (rounded) logits
    torch.testing.assert_close(x.grad.float(), y.grad, **tol)


def test_compiled_layers_equal_eager_on_cuda():
    """``--compile`` compiles each transformer layer on CUDA; the numbers stay the eager ones (fp32)."""
    from ptdp.ops.fused import compile_layers

    cfg = _model_config()
    tokens = _tokens(cfg).cuda()
    eager = _loss_and_grads(_model("cuda", cfg), tokens)
    compiled_model = _model("cuda", _model_config(compile=True))
    assert compile_layers(compiled_model.layers.values(), (2, cfg.seq_length, cfg.hidden_size), torch.float32)
    compiled = _loss_and_grads(compiled_model, tokens)
    torch.testing.assert_close(compiled[0], eager[0], **FP32)
    for name, grad in eager[2].items():
        torch.testing.assert_close(compiled[2][name], grad, rtol=1e-3, atol=1e-5, msg=name)


def test_rng_tracker_add_leaves_every_generator_alone():
    from ptdp.parallel.tensor import random as tp_random

    torch.manual_seed(3)
    cpu, cuda = torch.get_rng_state(), torch.cuda.get_rng_state()
    tracker = tp_random.RNGStatesTracker(torch.device("cuda", torch.cuda.current_device()))
    tracker.add("stream", 99)
    assert torch.equal(torch.get_rng_state(), cpu) and torch.equal(torch.cuda.get_rng_state(), cuda)
    with tracker.fork("stream"):
        drawn = torch.rand(4, device="cuda")
    assert torch.equal(torch.cuda.get_rng_state(), cuda)
    torch.cuda.manual_seed(99)
    assert torch.equal(drawn, torch.rand(4, device="cuda"))


# -------------------------------------------------------------------------------- training runs


def test_bf16_training_tracks_fp32(tmp_path):
    """t=p=d=1 on the GPU: bf16 (fp32 main weights and grads) stays within bf16 tolerance of fp32."""
    extra = ["--train-iters", "20", "--lr", "3e-3", "--log-interval", "10"]
    fp32 = losses(train_metrics(tmp_path, 1, extra))
    bf16 = losses(train_metrics(tmp_path, 1, [*extra, "--bf16"]))
    assert fp32[-1] < fp32[0] - 0.3  # it trains
    assert bf16 == pytest.approx(fp32, rel=0.03)
    compiled = losses(train_metrics(tmp_path, 1, [*extra, "--bf16", "--compile"]))
    assert compiled == pytest.approx(bf16, rel=0.03)


def test_checkpoints_move_between_cuda_and_cpu(tmp_path):
    """Saved at iteration 2 on one device type, resumed on the other: iterations 3-4 are the CPU run's."""
    four = ["--train-iters", "4"]
    reference = train_metrics(tmp_path, 1, four, env=CPU_ONLY)
    for saver, resumer in ((None, CPU_ONLY), (CPU_ONLY, None)):  # CUDA -> CPU, then CPU -> CUDA
        ckpt = tmp_path / f"ckpt-{'cpu' if saver else 'cuda'}"
        first = train_metrics(tmp_path, 1, [*four, "--exit-interval", "2", "--save", str(ckpt)], env=saver)
        resumed = train_metrics(tmp_path, 1, [*four, "--load", str(ckpt)], env=resumer)
        assert [r["iteration"] for r in resumed] == [3, 4]
        assert_same_run(first + resumed, reference, 1e-4)  # losses and gradient norms


def steady_state_records(monkeypatch, tmp_path, extra: list[str]) -> list[dict]:
    """8 iterations of TINY + ``extra`` in this process with ``torch.cuda.set_sync_debug_mode("error")`` on
    from iteration 2 for the whole loop except the one read of the logged records (``read_records``) and
    the checkpoint manager's ``finish``: any other host-device sync raises. The records."""
    import ptdp.train.loop as training
    import ptdp.train.steppers as steppers

    original_step, original_read = steppers.train_step, training.read_records

    def train_step(trainer, iteration):
        if iteration >= 2:
            torch.cuda.set_sync_debug_mode("error")
        return original_step(trainer, iteration)

    def read_records(trainer, records):
        torch.cuda.set_sync_debug_mode("default")
        try:
            return original_read(trainer, records)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    original_finish = training.CheckpointManager.finish

    def finish(self, last_iteration):
        torch.cuda.set_sync_debug_mode("default")
        return original_finish(self, last_iteration)

    monkeypatch.setattr(steppers, "train_step", train_step)
    monkeypatch.setattr(training, "read_records", read_records)
    monkeypatch.setattr(training.CheckpointManager, "finish", finish)
    try:
        return training.train(validated_config([*TINY, *extra, "--train-iters", "8", "--log-interval", "4",
                                                "--save", str(Path(tmp_path) / "ckpt"), "--save-interval", "100"]))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("extra", [[], ["--bf16"], ["--bf16", "--compile"], ["--bf16", "--use-distributed-optimizer"]],
                         ids=["fp32", "bf16", "bf16-compile", "bf16-zero1"])
def test_steady_state_never_waits_for_the_gpu(monkeypatch, tmp_path, extra):
    """From iteration 2 on, ``torch.cuda.set_sync_debug_mode("error")`` is on for the whole loop except
    the one read of the logged records (``read_records``): any other host-device sync raises."""
    records = steady_state_records(monkeypatch, tmp_path, extra)
    assert len(records) == 8 and all(r["loss"] == r["loss"] for r in records)
    assert records[-1]["mfu"] is None or 0 < records[-1]["mfu"] < 1
