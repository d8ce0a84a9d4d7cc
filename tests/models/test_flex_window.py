"""The FlexAttention path of windowed / sink / soft-capped attention (``ptdp.ops.flex_window``) against the
exact tiles (``ptdp.models.window``), the CPU's path and the reference.

On the CPU torch's FlexAttention runs eagerly, forward only (its backward raises "FlexAttention does not
support backward on CPU"): the forward is compared here, forcing the choice, through the model's attention
core, with and without packed documents; the backward is compared on CUDA (``tests/gpu``, skipped without a
GPU), where start-up chooses the path after probing its forward and backward. Start-up on the CPU keeps the
exact tiles and says why in one line.
"""

from __future__ import annotations

import pytest
import torch

from ptdp.models.documents import DocumentLayout
from ptdp.models.layers import CausalAttention, use_window_kernel
from ptdp.ops.document_attention import PerDocument
from ptdp.ops.flex_window import OVERRIDE, FlexWindow, select_window_attention

BOUNDS = [[0, 5, 6, 19, 24], [0, 24]]  # documents of 5, 1, 13, 5 tokens; one of the whole sample
# (window, sinks, cap, documents): each feature alone and together, a window longer than the sequence
CASES = [(3, False, None, False), (None, True, None, False), (None, False, 2.0, False), (5, True, 2.0, False),
         (40, True, None, False), (3, True, 2.0, True), (None, True, None, True), (8, False, 2.0, True)]


def _inputs(seed: int, device: str = "cpu", requires_grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 4, 24, 16, generator=g).to(device).requires_grad_(requires_grad) for _ in range(3))
    sinks = torch.randn(4, generator=g).to(device).requires_grad_(requires_grad)
    return q, k, v, sinks


def _run(core: CausalAttention, case, q, k, v, sinks):
    window, with_sinks, cap, documents = case
    layout = DocumentLayout(BOUNDS, None, PerDocument()) if documents else None
    return core(q, k, v, 0.0, layout, scale=0.3, sinks=sinks if with_sinks else None)


@pytest.mark.parametrize("case", CASES)
def test_flex_forward_equals_the_exact_tiles_on_the_cpu(case):
    q, k, v, sinks = _inputs(CASES.index(case))
    exact, flex = CausalAttention(case[0], case[2]), CausalAttention(case[0], case[2])
    use_window_kernel([flex], FlexWindow(compiled=False))
    assert flex.kernel is not None and exact.kernel is None
    with torch.no_grad():
        want = _run(exact, case, q, k, v, sinks)
        torch.testing.assert_close(_run(flex, case, q, k, v, sinks), want, rtol=1e-5, atol=1e-5)
        # the control: each feature matters (no window, no sinks, no cap: other outputs)
        assert not torch.allclose(_run(CausalAttention(), (None, False, None, case[3]), q, k, v, sinks), want,
                                  atol=1e-3)


def test_start_up_keeps_the_exact_tiles_on_the_cpu_and_a_forced_choice_wins(monkeypatch):
    monkeypatch.delenv(OVERRIDE, raising=False)
    kernel, line = select_window_attention(torch.device("cpu"), torch.float32)
    assert kernel is None and line.startswith("windowed attention: exact tiles") and "\n" not in line
    monkeypatch.setenv(OVERRIDE, "flex")
    kernel, line = select_window_attention(torch.device("cpu"), torch.float32)
    assert isinstance(kernel, FlexWindow) and not kernel.compiled and OVERRIDE in line
    monkeypatch.setenv(OVERRIDE, "fast")
    with pytest.raises(ValueError, match=OVERRIDE):
        select_window_attention(torch.device("cpu"), torch.float32)


def test_flex_applies_only_without_dropout():
    q, k, v, _ = _inputs(0)
    kernel = FlexWindow(compiled=False)
    assert kernel.applies(q, k, v, 0.0) and not kernel.applies(q, k, v, 0.1)
    assert not kernel.applies(q, k, v[..., :8], 0.0)  # values narrower than the keys (multi-latent attention)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention has no backward on the CPU")
@pytest.mark.parametrize("case", CASES)
def test_flex_forward_and_backward_equal_the_exact_tiles_on_cuda(case):
    q, k, v, sinks = _inputs(CASES.index(case), "cuda", requires_grad=True)
    exact, flex = CausalAttention(case[0], case[2]), CausalAttention(case[0], case[2])
    use_window_kernel([flex], FlexWindow())
    want, got = _run(exact, case, q, k, v, sinks), _run(flex, case, q, k, v, sinks)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    leaves = [q, k, v] + ([sinks] if case[1] else [])
    cotangent = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, leaves, cotangent), torch.autograd.grad(want, leaves, cotangent)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
