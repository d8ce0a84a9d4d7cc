"""The single-process mixture-of-experts layer: routing, capacity, grouped GEMM, auxiliary losses,
zero-bubble deferral, recomputation, the flags and one training run."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY, refused_in_process, run_ptdp

from ptdp.config import ModelConfig, MoEConfig
from ptdp.models import GPTModel, MoELayer
from ptdp.models.moe import moe_layer_pattern
from ptdp.ops.weight_grad import defer_weight_grads

H, F_, E = 16, 8, 4


def _layer(swiglu: bool = True, **moe) -> MoELayer:
    cfg = ModelConfig(hidden_size=H, num_attention_heads=2, ffn_hidden_size=F_, swiglu=swiglu)
    layer = MoELayer(cfg, MoEConfig(**{"num_experts": E, "moe_router_topk": 2, **moe}))
    torch.manual_seed(0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def _reference(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Token by token: its top-k experts (Mixtral's softmax, top-k, renormalise), weighted sum."""
    flat = x.reshape(-1, H)
    logits = flat @ layer.router.weight.t()
    probs, idx = torch.softmax(logits, -1).topk(2, -1)
    probs = probs / probs.sum(-1, keepdim=True)
    w1, w2 = layer.experts.fc1_weight, layer.experts.fc2_weight
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j in range(2):
            e = idx[t, j]
            gate, up = w1[e, 0] @ flat[t], w1[e, 1] @ flat[t]
            out[t] += probs[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out.view_as(x)


@pytest.mark.parametrize("grouped", [False, True])
def test_layer_matches_per_token_reference_forward_and_backward(grouped):
    layer = _layer(moe_grouped_gemm=grouped)
    x = torch.randn(2, 6, H, requires_grad=True)
    y = layer(x)
    x2 = x.detach().clone().requires_grad_()
    ref = _reference(layer, x2)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *layer.parameters()], g)
    want = torch.autograd.grad(ref, [x2, *layer.parameters()], g)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_pre_softmax_router_does_not_renormalise():
    layer = _layer(moe_router_pre_softmax=True)
    x = torch.randn(10, H)
    probs, idx, _ = layer.router(x)
    full = torch.softmax(x @ layer.router.weight.t(), -1)
    torch.testing.assert_close(probs, full.gather(1, idx))
    assert (probs.sum(-1) < 1).all()


def test_capacity_drops_least_probable_and_padding_changes_nothing():
    x = torch.randn(3, 8, H)
    dropless = _layer()(x)
    layer = _layer(moe_expert_capacity_factor=0.5)
    probs, idx, _ = layer.router(x.reshape(-1, H))
    capacity = 6  # ceil(24 tokens * 2 / 4 experts * 0.5)
    counts = torch.bincount(idx.flatten(), minlength=E + 1)
    assert (counts[:E] <= capacity).all() and counts[E] > 0
    assert (probs[idx == E] == 0).all()
    full_probs, full_idx, _ = _layer().router(x.reshape(-1, H))  # the same weights, dropless
    dense = torch.zeros(24, E).scatter(1, full_idx, full_probs)
    for e in range(E):  # each expert kept its most probable assignments
        kept, routed = (idx == e).any(1), dense[:, e] > 0
        if (routed & ~kept).any():
            assert dense[kept, e].min() >= dense[routed & ~kept, e].max()
    dropped = layer(x)
    padded = _layer(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True)(x)
    torch.testing.assert_close(padded, dropped)
    assert not torch.allclose(dropped, dropless)


def test_aux_losses_values_and_gradients():
    layer = _layer(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    x = torch.randn(2, 6, H)
    logits = (x.reshape(-1, H) @ layer.router.weight.t())
    _, idx = logits.topk(2, -1)
    f = torch.bincount(idx.flatten(), minlength=E).float() / (12 * 2)
    p = torch.softmax(logits, -1).mean(0)
    aux = 0.1 * E * (f * p).sum()
    z = 0.01 * torch.logsumexp(logits, -1).square().mean()
    _, _, losses = layer.router(x.reshape(-1, H))
    torch.testing.assert_close(losses["load_balancing_loss"], aux)
    torch.testing.assert_close(losses["z_loss"], z)
    # the backward of (layer output · g) carries the auxiliary losses with weight aux_loss_scale
    layer.aux_loss_scale = 0.5
    g = torch.randn(2, 6, H)
    (layer(x) * g).sum().backward()
    got = layer.router.weight.grad.clone()
    layer.zero_grad()
    layer.aux_loss_scale = 0.0
    (layer(x) * g).sum().backward()
    _, _, losses = layer.router(x.reshape(-1, H))
    (0.5 * (losses["load_balancing_loss"] + losses["z_loss"])).backward()
    torch.testing.assert_close(got, layer.router.weight.grad, rtol=1e-5, atol=1e-7)
    assert set(layer.stats) == {"load", "dropped", "load_balancing_loss", "z_loss"}


def test_seq_aux_loss_is_mean_of_per_sequence_losses():
    layer = _layer(moe_aux_loss_coeff=0.1, moe_router_load_balancing_type="seq_aux_loss")
    x = torch.randn(3, 5, H)
    per_seq = [layer.router(x[i])[2]["load_balancing_loss"] for i in range(3)]
    torch.testing.assert_close(layer.router(x.reshape(-1, H), num_sequences=3)[2]["load_balancing_loss"],
                               torch.stack(per_seq).mean())


@pytest.mark.parametrize("grouped", [False, True])
def test_zero_bubble_defers_expert_weight_grads(grouped):
    layer = _layer(moe_grouped_gemm=grouped, moe_aux_loss_coeff=0.1)
    x = torch.randn(2, 6, H)
    g = torch.randn(2, 6, H)
    (layer(x) * g).sum().backward()
    want = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    with defer_weight_grads(layer.parameters()) as store:
        (layer(x) * g).sum().backward()
    assert layer.experts.fc1_weight.grad is None and layer.router.weight.grad is None  # all in the W pass
    store.run()
    for n, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-7)


def test_gelu_experts_and_layer_pattern():
    layer = _layer(swiglu=False)
    assert layer.experts.fc1_weight.shape == (E, 1, F_, H)
    assert layer(torch.randn(1, 3, H)).shape == (1, 3, H)
    assert moe_layer_pattern("2", 4) == [True, False, True, False]
    assert moe_layer_pattern("[0,1,1,0]", 4) == [False, True, True, False]
    assert moe_layer_pattern("([1]*1+[0])*2", 4) == [True, False, True, False]
    for bad in ("0", "[1,0]", "__import__('os')"):
        with pytest.raises(ValueError, match="--moe-layer-freq"):
            moe_layer_pattern(bad, 4)


def test_recompute_counts_statistics_once():
    from ptdp.parallel.recompute import apply_recompute
    from ptdp.parallel.tensor.random import MODEL_PARALLEL_RNG, get_rng_tracker

    if MODEL_PARALLEL_RNG not in get_rng_tracker().states:
        get_rng_tracker().add(MODEL_PARALLEL_RNG, 1)
    cfg = ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=2, seq_length=8, hidden_dropout=0.0,
                      attention_dropout=0.0)
    moe = MoEConfig(num_experts=E, moe_aux_loss_coeff=0.1)
    tokens = torch.randint(0, 50, (2, 8))
    runs = []
    for granularity in (None, "full"):
        torch.manual_seed(0)
        model = GPTModel(cfg, 50, 64, moe)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.1)
        apply_recompute(model, granularity, None, None)
        model(tokens).float().logsumexp(-1).mean().backward()
        runs.append((model.layers["0"].mlp.stats["load"], [p.grad for p in model.parameters()]))
    torch.testing.assert_close(runs[1][0], runs[0][0])
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        torch.testing.assert_close(a, b)


def test_topk_above_num_experts_is_one_line_exit_2(capsys):
    proc = refused_in_process(["train", *TINY, "--num-experts", "2", "--moe-router-topk", "3"], capsys)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if "moe" in line]
    assert lines == ["ptdp train: error: --moe-router-topk 3 must be between 1 and --num-experts 2"]
    assert "Traceback" not in proc.stderr


def test_training_run_reports_moe_metrics(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    proc = run_ptdp(["train", *TINY, "--swiglu", "--num-experts", "4", "--moe-router-topk", "2",
                     "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001", "--moe-grouped-gemm",
                     "--moe-layer-freq", "[1,0,1,1]", "--moe-expert-capacity-factor", "1.0",
                     "--recompute-granularity", "full", "--metrics-file", str(metrics), "--save", str(tmp_path / "ck"),
                     "--tensorboard-dir", str(tmp_path / "tb")])
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(records) == 3 and records[-1]["loss"] < records[0]["loss"] + 0.1
    for r in records:
        assert r["moe_aux_loss"] > 0 and r["moe_z_loss"] > 0 and r["moe_max_load_ratio"] >= 1.0
        assert r["moe_dropped_tokens"] >= 0
    assert "max expert load/mean:" in proc.stdout and "dropped tokens:" in proc.stdout
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for tag, key in (("moe/aux_loss", "moe_aux_loss"), ("moe/max_load_over_mean", "moe_max_load_ratio"),
                     ("moe/dropped_tokens", "moe_dropped_tokens"), ("moe/z_loss", "moe_z_loss")):
        assert [s.value for s in events.Scalars(tag)] == pytest.approx([r[key] for r in records], rel=1e-6)
    # the checkpoint holds 4 experts per layer: loading it with 2 is one line, no traceback
    other = refused_in_process(["train", *TINY, "--swiglu", "--num-experts", "2", "--moe-layer-freq",
                                "[1,0,1,1]", "--train-iters", "4", "--load", str(tmp_path / "ck")], capsys)
    assert other.returncode != 0 and "Traceback" not in other.stderr
    assert "mlp.router.weight is (4, 32) there, (2, 32) here" in other.stderr.strip().splitlines()[-1]


def test_flops_and_parameters_count_active_experts():
    from ptdp.models import flops
    from ptdp.planner.spec import MODEL_PRESETS

    mixtral = MODEL_PRESETS["mixtral-8x7b"]  # published: 46.7B parameters, 12.9B active
    assert round(mixtral.parameter_count() / 1e9, 1) == 46.7
    assert round(mixtral.parameter_count(active=True) / 1e9, 1) == 12.9
    qwen = MODEL_PRESETS["qwen1.5-moe-a2.7b"]  # published: 14.3B, 2.7B active
    assert round(qwen.parameter_count() / 1e9, 1) == 14.3
    assert round(flops.model_parameter_count(qwen, moe=qwen.moe, active=True) / 1e9, 1) == 2.7
    # an MoE layer with k experts of hidden size f costs a dense layer of ffn k·f plus the router 2·h·E
    shape = flops.MoEShape(num_experts=8, topk=2, ffn=96, moe_layers=2)
    moe = flops.flops_per_iteration(4, 64, 32, 100, 8, False, 128, swiglu=True, moe=shape)
    dense = flops.flops_per_iteration(4, 64, 32, 100, 8, False, 128, swiglu=True)
    dense_k = flops.flops_per_iteration(4, 64, 32, 100, 8, False, 2 * 96, swiglu=True)
    router = 2 * 3 * (2 * 8 * 32 * 64 * 8)  # MoE layers x passes x 2·tokens·h·E
    assert moe - dense == (dense_k - dense) // 2 + router


def test_planner_sees_the_experts():
    from ptdp.planner.spec import MODEL_PRESETS

    mixtral = MODEL_PRESETS["mixtral-8x7b"]
    assert mixtral.active_ffn == 2 * 14336 and mixtral.parameter_ffn == 8 * 14336
    assert MODEL_PRESETS["llama3-8b"].active_ffn == MODEL_PRESETS["llama3-8b"].ffn


def test_grouped_linear_with_an_expert_without_tokens():
    from ptdp.ops.grouped import grouped_linear

    counts = torch.tensor([3, 0, 5])
    results = []
    for grouped in (False, True):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)).requires_grad_()
        w = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
        grouped_linear(x, w, counts, grouped).square().sum().backward()
        results.append((x.grad, w.grad))
    assert torch.equal(results[1][1][1], torch.zeros(8, 16))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b)
