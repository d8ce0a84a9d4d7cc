"""Gemma 2's logit soft-capping (``--attn-logit-softcapping``, ``--final-logit-softcapping``): cap·tanh(x/cap)
on the attention scores and on the output logits. The attention core against a hand-written capped softmax
(windows, documents), an imported random HF Gemma 3 with its final cap set against HF's logits (HF's Gemma 3
keeps ``attn_logit_softcapping`` in its config but never applies it, so the import drops it), and the
combinations the configuration refuses."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ptdp.models.documents import DocumentLayout
from ptdp.models.layers import CausalAttention, softcap_logits
from ptdp.ops.document_attention import PerDocument

transformers = pytest.importorskip("transformers")


def _capped_reference(q, k, v, window, cap, bounds=None):
    s = q.shape[-2]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = ((j <= i) & (i - j < (window or s))).expand(q.shape[0], 1, s, s).clone()
    if bounds is not None:
        same = torch.zeros_like(allowed)
        for b, cu in enumerate(bounds):
            for a, e in zip(cu[:-1], cu[1:]):
                same[b, 0, a:e, a:e] = True
        allowed &= same
    scores = q @ k.transpose(-1, -2) * 0.3
    scores = (cap * torch.tanh(scores / cap)).masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("window", [None, 3, 40])
@pytest.mark.parametrize("packed", [False, True], ids=["window", "documents"])
def test_capped_attention_equals_a_hand_written_capped_softmax(window, packed):
    g = torch.Generator().manual_seed(11)
    q, k, v = (3 * torch.randn(2, 3, 24, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    bounds = [[0, 7, 8, 24], [0, 24]] if packed else None
    layout = DocumentLayout(bounds, None, PerDocument()) if packed else None
    got = CausalAttention(window, softcap=2.0)(q, k, v, 0.0, layout, scale=0.3)
    want = _capped_reference(q, k, v, window, 2.0, bounds)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    leaves, cotangent = [q, k, v], torch.randn(got.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, leaves, cotangent), torch.autograd.grad(want, leaves, cotangent)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # the control: without the cap the scores (|q·k|·0.3 well above 2) give other outputs
    assert not torch.allclose(CausalAttention(window)(q, k, v, 0.0, layout, scale=0.3), want, atol=1e-3)


def test_final_cap_is_elementwise_and_keeps_the_padding_masked():
    logits = torch.tensor([[5.0, -7.0, 0.5, float("-inf")]])
    torch.testing.assert_close(softcap_logits(logits, 2.0)[:, :3], 2.0 * torch.tanh(logits[:, :3] / 2.0))
    assert softcap_logits(logits, 2.0)[0, 3] == float("-inf")
    # a vocabulary shard capped alone is the whole row capped, cut (what tensor parallelism's shards do)
    torch.testing.assert_close(torch.cat([softcap_logits(x, 2.0) for x in logits.split(2, -1)], -1),
                               softcap_logits(logits, 2.0))


def test_imported_gemma3_with_both_caps_gives_hf_logits(tmp_path):
    from test_gemma3 import KINDS, S, V, W

    from ptdp.checkpointing import read_full_model_state
    from ptdp.config import ConfigError, MoEConfig
    from ptdp.hf.convert import full_model_from_state, import_hf_model, train_flags
    from ptdp.models.gemma3.hf import gemma3_config

    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=len(KINDS), num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=4096, initializer_range=0.3, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, sliding_window=W, query_pre_attn_scalar=20,
        layer_types=KINDS, attn_logit_softcapping=1.5, final_logit_softcapping=2.0, attn_implementation="eager",
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    hf = transformers.Gemma3ForCausalLM(config).float().eval()
    hf.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    _, cfg, moe = import_hf_model(tmp_path / "hf", tmp_path / "ckpt")
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (None, 2.0)
    flags = train_flags(cfg, moe).split()
    assert float(flags[flags.index("--final-logit-softcapping") + 1]) == 2.0  # ptdp train --load is given the cap
    ours = full_model_from_state(*read_full_model_state(tmp_path / "ckpt"))
    tokens = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        torch.testing.assert_close(ours(tokens)[..., :V], expected, rtol=0, atol=1e-5)
        assert expected.abs().max() < 2.0  # the final cap bites: without it, other logits
        ours.logits.softcap = None
        assert not torch.allclose(ours(tokens)[..., :V], expected, atol=1e-3)
    with pytest.raises(ConfigError, match="--attn-logit-softcapping"):  # HF's Gemma 3 would not apply it
        gemma3_config(dataclasses.replace(cfg, attn_logit_softcapping=1.5), MoEConfig(), None, None)


@pytest.mark.parametrize("world, overrides, line", [
    (1, {"attn_logit_softcapping": 0.0}, "--attn-logit-softcapping must be > 0"),
    (1, {"attn_logit_softcapping": 5.0, "multi_latent_attention": True}, "--attn-logit-softcapping with --multi-"),
])
def test_softcapping_refuses_what_it_does_not_compute_in_one_line(world, overrides, line):
    from helpers import config_errors

    errors = config_errors(world, **overrides)
    assert any(e.startswith(line) for e in errors), errors
    assert all("\n" not in e for e in errors)


P2_VOCAB = ["--pipeline-model-parallel-size", "2", "--enable-vocab-parallel"]


def test_capped_training_equals_one_process_under_tensor_and_pipeline_parallelism(tmp_path):
    """``ptdp train`` with both caps and windows: t = 2 with sequence parallelism (each vocabulary shard caps
    its own logits before the vocabulary-parallel cross-entropy), p = 2, and vocabulary parallelism (one
    barrier, and two with t = 2) give one process's losses and gradient norms per iteration and its final
    weights; without the caps the run differs (they bite)."""
    from helpers import TINY, assert_equivalent, run_layouts

    caps = ["--attn-logit-softcapping", "0.05", "--final-logit-softcapping", "0.05", "--window-size", "5",
            "--window-attn-skip-freq", "2"]
    runs = run_layouts(tmp_path, {"one": (1, caps), "plain": (1, caps[4:]),
                                  "t2-sp": (2, [*caps, "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                                  "p2": (2, [*caps, "--pipeline-model-parallel-size", "2"]),
                                  # the vocabulary passes cap each slice's logits, their gradients through the
                                  # cap's slope: with one barrier (the input terms from S) and with two
                                  "p2-vocab": (2, [*caps, *P2_VOCAB]),
                                  "p2-t2-vocab-2b": (4, [*caps, *P2_VOCAB, "--tensor-model-parallel-size", "2",
                                                          "--disable-fb-fusion"])}, base=TINY)
    for name in ("t2-sp", "p2", "p2-vocab", "p2-t2-vocab-2b"):
        assert_equivalent(runs[name], runs["one"])
    one, plain = runs["one"].records, runs["plain"].records
    assert abs(one[-1]["loss"] - plain[-1]["loss"]) > 1e-3, (one[-1], plain[-1])
