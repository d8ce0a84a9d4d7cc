"""``--fp8-format``: flags, clear errors where FP8 cannot run, and torchao's FP8 GEMMs wired into
the transformer layers only. On the CPU the FP8 casts run emulated (torchao's ``emulate=True``: the same
scales and fp8 rounding, high-precision GEMMs); the real FP8 GEMMs are in the GPU tier (``pytest -m gpu``)."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY, refused_in_process

from ptdp.config import ModelConfig

torchao = pytest.importorskip("torchao", reason="FP8 needs torchao (pip install torchao)")


def _model(vocab: int = 200):
    from ptdp.models import GPTModel
    from ptdp.parallel.init import init_parameters
    from ptdp.parallel.parallelize import parallelize
    from ptdp.parallel.placement import Placements

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, hidden_dropout=0.0,
                      attention_dropout=0.0)
    placements = Placements()
    model = parallelize(GPTModel(cfg, vocab, cfg.padded_vocab_size(vocab, 1)), placements)  # t = 1: FP8's linears
    init_parameters(model, 1234, cfg.init_method_std, cfg.num_layers, placements)
    return model.bfloat16()


def _loss_and_grads(model, tokens):
    from ptdp.parallel.tensor import language_model_loss

    loss = language_model_loss(model(tokens[:, :-1]), tokens[:, 1:]).float()
    loss.backward()
    return loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters()}


def test_only_the_transformer_linears_go_fp8():
    from ptdp.parallel.fp8 import enable_fp8

    model = _model()
    switched = enable_fp8([model], "hybrid", emulate=True)
    assert switched == [f"layers.{i}.{name}" for i in range(2)
                        for name in ("attention.qkv", "attention.proj", "mlp.fc1", "mlp.fc2")]
    names = {n for n, m in model.named_modules() if getattr(m, "fp8_linear", None) is not None}
    assert names == set(switched)  # embedding and output layer stay bf16


@pytest.mark.parametrize("fmt,recipe", [("e4m3", "tensorwise"), ("hybrid", "tensorwise"), ("e4m3", "rowwise")])
def test_emulated_fp8_tracks_bf16_but_is_not_bf16(fmt, recipe):
    """FP8 rounding changes the numbers (so the GEMMs really are FP8), but stays within a few percent of bf16."""
    from ptdp.parallel.fp8 import enable_fp8

    tokens = torch.randint(0, 200, (2, 33), generator=torch.Generator().manual_seed(0))
    reference, ref_grads = _loss_and_grads(_model(), tokens)
    model = _model()
    enable_fp8([model], fmt, recipe, emulate=True)
    loss, grads = _loss_and_grads(model, tokens)
    assert loss != reference and loss == pytest.approx(reference, rel=2e-2)
    for name, grad in grads.items():
        cos = torch.nn.functional.cosine_similarity(grad.flatten(), ref_grads[name].flatten(), dim=0)
        assert cos > 0.98, (name, cos)


def test_e4m3_and_hybrid_differ_in_the_gradient_dtype():
    from ptdp.parallel.fp8 import float8_config

    assert float8_config("e4m3").cast_config_grad_output.target_dtype == torch.float8_e4m3fn
    assert float8_config("hybrid").cast_config_grad_output.target_dtype == torch.float8_e5m2
    assert float8_config("e4m3").cast_config_input.target_dtype in (None, torch.float8_e4m3fn)


@pytest.mark.parametrize("flags,message", [
    (["--fp8-format", "e4m3"], "--fp8-format needs --bf16"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "rowwise", "--bf16"], "--fp8-recipe rowwise needs --fp8-format e4m3"),
    (["--fp8-format", "e5m2", "--bf16"], "--fp8-format"),
])
def test_bad_fp8_flags_are_one_line(flags, message, capsys):
    proc = refused_in_process(["train", *TINY, *flags], capsys)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message")
def test_fp8_without_an_fp8_gpu_names_the_requirement(capsys):
    proc = refused_in_process(["train", *TINY, "--fp8-format", "hybrid", "--bf16"], capsys)
    assert proc.returncode == 2 and "compute capability >= 8.9" in proc.stderr and "Traceback" not in proc.stderr


def test_fp8_without_torchao_names_the_package(monkeypatch):
    import importlib.util

    from ptdp.config import Config
    from ptdp.parallel.fp8 import fp8_environment_errors

    config = Config()
    config.precision.fp8_format, config.precision.bf16 = "e4m3", True
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    assert fp8_environment_errors(config) == ["--fp8-format needs torchao (pip install torchao, or pip install 'ptdp[fp8]')"]
