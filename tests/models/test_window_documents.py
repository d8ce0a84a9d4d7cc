"""Packed documents (``--reset-attention-mask``) with sliding windows and attention sinks in one process: the
window mask intersected with the document mask. The core against a naive masked softmax (values and
gradients), a packed sample through an imported random Gemma 3 against HF on each document alone, and the
gradients of a packed batch against the same documents run one by one, and ``ptdp train`` on packed
documents with windows and sinks at t = 2 + SP, p = 2 and c = 2 (each ``--cp-comm-type``) against one process,
and a Gemma-like model with capped scores at c = 2."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ptdp.data.documents import positions
from ptdp.models.documents import DocumentLayout
from ptdp.models.layers import CausalAttention
from ptdp.ops.document_attention import PerDocument

transformers = pytest.importorskip("transformers")

BOUNDS = [[0, 5, 6, 19, 24], [0, 24]]  # documents of 5, 1, 13, 5 tokens; one of the whole sample


def _naive(q, k, v, window, scale, sinks):
    s = q.shape[-2]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = torch.zeros(len(BOUNDS), 1, s, s, dtype=torch.bool)
    for b, cu in enumerate(BOUNDS):
        for a, e in zip(cu[:-1], cu[1:]):
            allowed[b, 0, a:e, a:e] = True
    allowed &= (j <= i) & (i - j < (window or s))
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return scores.softmax(-1) @ v
    sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], -1).softmax(-1)[..., :-1] @ v


@pytest.mark.parametrize("window, with_sinks", [(1, False), (3, False), (8, False), (40, False), (3, True),
                                                (None, True)])
def test_windows_inside_documents_equal_a_naive_masked_softmax(window, with_sinks):
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 3, 24, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sinks = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True) if with_sinks else None
    layout = DocumentLayout(BOUNDS, None, PerDocument())
    got = CausalAttention(window)(q, k, v, 0.0, layout, scale=0.3, sinks=sinks)
    want = _naive(q, k, v, window, 0.3, sinks)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    leaves = [q, k, v] + ([sinks] if with_sinks else [])
    cotangent = torch.randn(got.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, leaves, cotangent), torch.autograd.grad(want, leaves, cotangent)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # the control: the window alone (no documents) computes other outputs (w = 1 sees only the token itself)
    if window is not None and window > 1:
        assert not torch.allclose(CausalAttention(window)(q, k, v, 0.0, scale=0.3, sinks=sinks), want)


def test_a_packed_gemma3_sample_equals_its_documents_alone(tmp_path):
    """An imported random Gemma 3 (windows of 8; documents of 12, 3 and 17 tokens: the windows bite inside
    the long ones): the packed sample's logits equal HF's on each document alone, and the gradient of the
    packed loss equals the gradient of the per-document losses summed (ptdp's model, no layout)."""
    from test_gemma3 import S, V, hf_model

    from ptdp.checkpointing import read_full_model_state
    from ptdp.hf.convert import full_model_from_state, import_hf_model

    hf = hf_model(tmp_path / "hf")
    import_hf_model(tmp_path / "hf", tmp_path / "ckpt")
    ours = full_model_from_state(*read_full_model_state(tmp_path / "ckpt"))
    bounds = [0, 12, 15, S]
    tokens = torch.randint(0, V, (1, S + 1), generator=torch.Generator().manual_seed(3))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    layout = DocumentLayout([bounds], torch.from_numpy(positions(bounds))[None], PerDocument())
    packed = ours(inputs, layout)[..., :V]
    with torch.no_grad():
        for a, e in zip(bounds[:-1], bounds[1:]):
            torch.testing.assert_close(packed[0, a:e], hf(inputs[:, a:e]).logits[0], rtol=0, atol=1e-5)
        assert not torch.allclose(ours(inputs)[0, 15:, :V], packed[0, 15:], atol=1e-3)  # the documents matter
    params = [p for p in ours.parameters() if p.requires_grad]
    grads = torch.autograd.grad(F.cross_entropy(packed[0], labels[0], reduction="sum"), params)
    alone = sum(F.cross_entropy(ours(inputs[:, a:e])[0, :, :V], labels[0, a:e], reduction="sum")
                for a, e in zip(bounds[:-1], bounds[1:]))
    for got, want in zip(grads, torch.autograd.grad(alone, params)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)  # fp32: sums in another order


def test_windows_sinks_and_caps_with_documents_validate_under_context_parallelism():
    from ptdp.config import Config, validate

    config = Config()
    config.model.window_size, config.model.softmax_type, config.data.reset_attention_mask = 4, "learnable", True
    config.model.attn_logit_softcapping, config.parallel.context_parallel_size = 5.0, 2
    assert not [e for e in validate(config, 2) if "--window-size" in e or "--softmax-type" in e or "capping" in e]


def test_packed_windowed_training_equals_one_process_in_tensor_pipeline_and_context_layouts(tmp_path):
    """``ptdp train`` on a corpus of short documents with the three packing flags. GPT-OSS-like: windows of 3 on
    every other layer and learned sinks; t = 2 with sequence parallelism, p = 2 and c = 2 under each
    ``--cp-comm-type`` give one process's losses and gradient norms per iteration and its final weights.
    Gemma-like (windows, q/k norms, GeGLU, capped scores): c = 2 under p2p and all-gather equals its one
    process. Without the document mask the run differs."""
    from helpers import TINY, assert_equivalent, run_layouts, short_documents

    # documents of 1 to 12 tokens: a few per 16-token sample, some longer than the window
    data = [*short_documents(tmp_path, 300), "--reset-position-ids", "--eod-mask-loss", "--window-size", "3",
            "--window-attn-skip-freq", "2"]
    flags = [*data, "--softmax-type", "learnable"]
    packed = [*flags, "--reset-attention-mask"]
    gemma = [*data, "--reset-attention-mask", "--qk-layernorm", "--geglu", "--attn-logit-softcapping", "2.0",
             "--position-embedding-type", "rope", "--local-rotary-base", "100"]

    def cp(comm: str) -> list[str]:
        return ["--context-parallel-size", "2", "--cp-comm-type", comm]

    runs = run_layouts(tmp_path / "runs", {
        "one": (1, packed), "unmasked": (1, flags),
        "t2-sp": (2, [*packed, "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        "p2": (2, [*packed, "--pipeline-model-parallel-size", "2"]),
        **{f"c2-{comm}": (2, [*packed, *cp(comm)]) for comm in ("p2p", "a2a", "allgather")},
        "gemma-one": (1, gemma), **{f"gemma-c2-{comm}": (2, [*gemma, *cp(comm)]) for comm in ("p2p", "allgather")},
    }, base=TINY)
    for name in ("t2-sp", "p2", "c2-p2p", "c2-a2a", "c2-allgather"):
        assert_equivalent(runs[name], runs["one"])
    for name in ("gemma-c2-p2p", "gemma-c2-allgather"):
        assert_equivalent(runs[name], runs["gemma-one"])
    assert abs(runs["one"].records[-1]["loss"] - runs["unmasked"].records[-1]["loss"]) > 1e-4
