"""The real B/W split (``ptdp.ops.weight_grad``): I then W is one ordinary backward, W touches
no graph, and zero-bubble training reproduces the single-process losses, gradient norms and weights with TP, SP, recomputation and
the distributed optimizer."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_equivalent, run_layouts
from torch import nn

from ptdp.config import ModelConfig
from ptdp.models import SequencePositions, TransformerLayer
from ptdp.ops.fused import EAGER
from ptdp.ops.norms import LayerNorm, RMSNorm
from ptdp.ops.weight_grad import defer_weight_grads, grad_deferred, linear

RTOL = 1e-4
GPT = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, hidden_dropout=0.0,
                  attention_dropout=0.0)
LLAMA = dataclasses.replace(GPT, normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
                            position_embedding_type="rope")


def layer_stack(cfg: ModelConfig, n: int = 2) -> nn.Sequential:
    torch.manual_seed(0)
    stack = nn.Sequential(*(TransformerLayer(cfg, EAGER, SequencePositions()) for _ in range(n)))
    for name, p in stack.named_parameters():  # non-trivial norms and biases, so their grads are tested
        with torch.no_grad():
            p.normal_(1.0 if "layernorm" in name else 0.0, 0.1)
    return stack


def grads_of(stack: nn.Sequential, x: torch.Tensor, split: bool) -> tuple[torch.Tensor, dict, dict]:
    for p in stack.parameters():
        p.grad = None
    hooks = {name: 0 for name, _ in stack.named_parameters()}

    def count(param: torch.Tensor, name: str) -> None:  # what the reducer counts for --overlap-grad-reduce
        if not grad_deferred(param):
            hooks[name] += 1

    handles = [p.register_post_accumulate_grad_hook(lambda q, n=name: count(q, n))
               for name, p in stack.named_parameters()]
    x = x.detach().requires_grad_(True)
    y = stack(x)
    g = torch.randn(y.shape)
    if split:
        with defer_weight_grads(stack.parameters()) as store:
            torch.autograd.backward(y, g)
        assert all(p.grad is None for p in stack.parameters()), "I computed a weight grad"
        with pytest.raises(RuntimeError):  # the graph is freed after I: W cannot be walking it
            torch.autograd.backward(y, g)
        assert len(store) > 0
        store.run()
    else:
        torch.autograd.backward(y, g)
    for h in handles:
        h.remove()
    return x.grad, {n: p.grad.clone() for n, p in stack.named_parameters()}, hooks


@pytest.mark.parametrize("cfg", [GPT, LLAMA, dataclasses.replace(GPT, recompute_granularity="selective")],
                         ids=["gpt", "llama", "selective"])
def test_input_then_weight_equals_one_backward(cfg):
    stack = layer_stack(cfg)
    x = torch.randn(2, cfg.seq_length, cfg.hidden_size)
    torch.manual_seed(1)
    dx_ref, ref, hooks_ref = grads_of(stack, x, split=False)
    torch.manual_seed(1)
    dx, got, hooks = grads_of(stack, x, split=True)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-6, atol=1e-7)
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=1e-7, msg=name)
    assert hooks == hooks_ref == dict.fromkeys(ref, 1)  # --overlap-grad-reduce counts one per microbatch


def test_full_recompute_closures_keep_recomputed_tensors():
    from ptdp.parallel.recompute import checkpoint

    stack = layer_stack(GPT)
    x = torch.randn(2, GPT.seq_length, GPT.hidden_size)
    stack(x).square().sum().backward()
    ref = [p.grad.clone() for p in stack.parameters()]
    for p in stack.parameters():
        p.grad = None
    xi = x.clone().requires_grad_(True)
    with defer_weight_grads(stack.parameters()) as store:
        checkpoint(stack, xi).square().sum().backward()
    store.run()
    for want, p in zip(ref, stack.parameters()):
        torch.testing.assert_close(p.grad, want, rtol=1e-6, atol=1e-7)


def test_ops_match_torch():
    """The custom Functions against torch's own modules (undeferred and deferred)."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8)
    cases = [(nn.LayerNorm(8), LayerNorm(8)), (nn.RMSNorm(8, eps=1e-5), RMSNorm(8, eps=1e-5))]
    for theirs, ours in cases:
        for p in theirs.parameters():
            nn.init.normal_(p, 1.0, 0.3)
        ours.load_state_dict(theirs.state_dict())
        for defer in (False, True):
            xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
            theirs.zero_grad(set_to_none=True)
            ours.zero_grad(set_to_none=True)
            theirs(xa).pow(3).sum().backward()
            if defer:
                with defer_weight_grads(ours.parameters()) as store:
                    ours(xb).pow(3).sum().backward()
                assert all(p.grad is None for p in ours.parameters())
                store.run()
            else:
                ours(xb).pow(3).sum().backward()
            torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-4, atol=1e-5)  # fp32 order
            for a, b in zip(theirs.parameters(), ours.parameters()):
                torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5)
    w = nn.Parameter(torch.randn(2, 4, 8))  # a fused [k, n, h] weight
    b = nn.Parameter(torch.randn(2, 4))
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    F.linear(xa, w.flatten(0, 1), b.flatten()).pow(2).sum().backward()
    want = (xa.grad, w.grad.clone(), b.grad.clone())
    w.grad = b.grad = None
    with defer_weight_grads([w, b]) as store:
        linear(xb, w, b).pow(2).sum().backward()
    assert w.grad is None and len(store) == 1
    store.run()
    for got, ref in zip((xb.grad, w.grad, b.grad), want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


ZB = ["--pipeline-schedule", "zb-h1", "--pipeline-model-parallel-size", "2"]
LAYOUTS = {
    "t2p2d2": (8, [*ZB, "--tensor-model-parallel-size", "2"]),
    "t2p2-sp-selective": (4, [*ZB, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                              "--recompute-granularity", "selective"]),
    "p2d2-distopt-overlap-full": (4, [*ZB, "--use-distributed-optimizer", "--overlap-grad-reduce",
                                      "--recompute-granularity", "full"]),
}
BF16 = ["--pipeline-model-parallel-size", "2", "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce"]
PLAN = {**LAYOUTS, "bf16-zb-h1": (4, [*BF16, "--pipeline-schedule", "zb-h1"]),
        "bf16-1f1b": (4, [*BF16, "--pipeline-schedule", "1f1b"])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("zb"), PLAN)


@pytest.mark.parametrize("name", LAYOUTS)
def test_zb_h1_matches_single_process(runs, reference, name):
    assert_equivalent(runs[name], reference, RTOL)


def test_zb_h1_bf16_matches_1f1b(runs):
    """--bf16: deferred 16-bit wgrads reach the fp32 main_grad through the same post-accumulate hooks, in
    the same order per microbatch, as 1F1B's full backward (with --overlap-grad-reduce counting them)."""
    assert_equivalent(runs["bf16-zb-h1"], runs["bf16-1f1b"], rtol=1e-5)
