"""Fused bias-GeLU / bias-dropout-add: compiled and eager give the same numbers, dropout masks included."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_run, train_metrics

from ptdp.ops import fused


@pytest.fixture(scope="module")
def compiled() -> fused.FusedOps:
    ops = fused.fused_ops(True)
    if not ops.compiled:
        pytest.skip("torch.compile is not usable here (the eager fallback is tested separately)")
    return ops


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(2, 16, 32), (32,), (2, 16, 32)]
    return [torch.randn(s, generator=g).requires_grad_(True) for s in shapes]


@pytest.mark.parametrize("name", ["bias_gelu", "bias_gelu_exact", "bias_dropout_add"])
def test_compiled_matches_eager_outputs_and_grads(compiled, name):
    results = []
    for ops in (fused.EAGER, compiled):
        y, bias, residual = _inputs()
        torch.manual_seed(5)  # dropout p=0.3 in training mode: the masks must be the same too
        if name.startswith("bias_gelu"):  # the tanh form (GPT-2's) and the exact one (--no-bias-gelu-fusion)
            out = ops.bias_gelu(y, bias, "none" if name == "bias_gelu_exact" else "tanh")
        else:
            out = ops.bias_dropout_add(y, bias, residual, 0.3, True)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        results.append([out.detach(), y.grad, bias.grad] + ([residual.grad] if name == "bias_dropout_add" else []))
    for eager, comp in zip(*results, strict=True):
        torch.testing.assert_close(comp, eager, rtol=1e-6, atol=1e-6)


def test_the_two_gelu_forms_differ():
    """Guards the exact form's comparison above: it is not the tanh form under another name."""
    y, bias, _ = _inputs()
    assert (fused.bias_gelu(y, bias, "none") - fused.bias_gelu(y, bias)).abs().max() > 1e-4


def test_dropout_really_drops():
    """Guards the comparison above: at p=0.3 about 30% of the outputs equal the residual alone."""
    y, bias, residual = _inputs()
    out = fused.bias_dropout_add(y, bias, residual, 0.3, True)
    dropped = (out == residual).float().mean().item()
    assert 0.2 < dropped < 0.4


def test_compile_failure_falls_back_to_eager_with_one_warning(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler found\nlong traceback...")

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(fused, "_compiled_ops", None)
    with pytest.warns(UserWarning, match=r"^--compile: torch.compile failed \(no C\+\+ compiler found\); "
                                         r"using the eager fused ops$"):
        ops = fused.fused_ops(True)
    assert ops is fused.EAGER


def test_compile_training_with_dropout_matches_eager(tmp_path, compiled):
    dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--train-iters", "2"]
    eager = train_metrics(tmp_path, 1, dropout)
    assert_same_run(train_metrics(tmp_path, 1, dropout + ["--compile"]), eager, 1e-5)
