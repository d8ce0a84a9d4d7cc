"""Packed documents: Megatron's three GPTDataset flags, the document attention kernels, and a packed
batch against its documents run one by one through Hugging Face's Llama (random weights, imported).

The layouts (t, p, c, ZeRO-3, e, vocabulary parallel) against one process: tests/parallel/test_packing_layouts.py;
context-parallel attention over documents: tests/parallel/test_packing_context.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_hf_llama_and_ours

from ptdp.data.documents import attention_pairs, cu_seqlens, loss_mask, positions, squared_lengths
from ptdp.models.documents import DocumentLayout
from ptdp.ops.document_attention import BY_NAME, Dense, PerDocument, dense_mask, select_document_attention

EOD = 9


def megatron_masks(tokens: np.ndarray, eod: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A literal reading of Megatron's ``_get_ltor_masks_and_position_ids`` with all three flags on: the
    [s, s] attention mask (True = attend), the loss mask and the position ids, by its loop over EODs."""
    s = len(tokens)
    attend = np.tril(np.ones((s, s), dtype=bool))
    loss = np.ones(s, dtype=np.float32)
    loss[tokens == eod] = 0.0
    pos = np.arange(s)
    prev = 0
    for i in np.flatnonzero(tokens == eod):
        attend[i + 1:, :i + 1] = False
        pos[i + 1:] -= i + 1 - prev
        prev = i + 1
    return attend, loss, pos


def random_tokens(s: int, seed: int, mean_doc: float = 5.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, EOD, s)
    tokens[rng.random(s) < 1.0 / mean_doc] = EOD
    return tokens


@pytest.mark.parametrize("seed", range(6))
def test_boundaries_positions_and_loss_mask_follow_megatron(seed):
    tokens = random_tokens(40, seed)
    if seed == 0:
        tokens[-1] = EOD  # an EOD as the last input: no empty document after it
    if seed == 1:
        tokens[:] = 3  # no EOD at all: one document
    bounds = cu_seqlens(tokens, EOD)
    attend, loss, pos = megatron_masks(tokens, EOD)
    assert bounds[0] == 0 and bounds[-1] == 40 and all(a < b for a, b in zip(bounds, bounds[1:]))
    np.testing.assert_array_equal(positions(bounds), pos)
    np.testing.assert_array_equal(loss_mask(tokens, EOD), loss)
    np.testing.assert_array_equal(dense_mask([bounds], 40, torch.device("cpu"))[0, 0].numpy(), attend)
    assert attention_pairs(bounds) == int(attend.sum())
    assert squared_lengths(bounds) == sum((b - a) ** 2 for a, b in zip(bounds, bounds[1:]))


def _qkv(b: int, h: int, s: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("name", ["per-document", "dense"])
def test_document_kernels_equal_attention_under_megatrons_mask(name):
    """Forward and backward of a kernel = SDPA with the mask Megatron builds (float64: no tolerance games)."""
    rows = [random_tokens(48, seed) for seed in (2, 3, 4)]
    bounds = [cu_seqlens(r, EOD) for r in rows]
    mask = torch.from_numpy(np.stack([megatron_masks(r, EOD)[0] for r in rows]))[:, None]
    q, k, v = _qkv(3, 2, 48, 8)
    dout = torch.randn(3, 2, 48, 8, dtype=torch.float64)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    grads = torch.autograd.grad(want, (q, k, v), dout)
    got = BY_NAME[name](q, k, v, bounds, 0.0, {})
    torch.testing.assert_close(got, want)
    for x, y in zip(torch.autograd.grad(got, (q, k, v), dout), grads):
        torch.testing.assert_close(x, y)
    # and the plain causal window is NOT what they compute (the test can fail)
    assert not torch.allclose(got, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_the_cpu_chooses_per_document_sdpa_and_says_why(monkeypatch):
    monkeypatch.delenv("PTDP_DOCUMENT_ATTENTION", raising=False)
    kernel, line = select_document_attention(torch.device("cpu"), torch.float32)
    assert isinstance(kernel, PerDocument) and "per-document SDPA" in line and "no backward" in line
    monkeypatch.setenv("PTDP_DOCUMENT_ATTENTION", "dense")
    kernel, line = select_document_attention(torch.device("cpu"), torch.float32)
    assert isinstance(kernel, Dense) and "fallback" in line
    monkeypatch.setenv("PTDP_DOCUMENT_ATTENTION", "nope")
    with pytest.raises(ValueError, match="PTDP_DOCUMENT_ATTENTION"):
        select_document_attention(torch.device("cpu"), torch.float32)


# ------------------------------------------------------------------------------- HF Llama, document by document

transformers = pytest.importorskip("transformers")


class _Samples:
    """A dataset of fixed samples (``get_microbatch`` reads ``dataset[i]``)."""

    def __init__(self, rows: list[np.ndarray]):
        self.rows = rows

    def __getitem__(self, i: int) -> np.ndarray:
        return self.rows[i]


def _packed_rows(n: int, s: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        row = rng.integers(0, 200, s + 1)
        row[rng.random(s + 1) < 0.15] = EOD  # documents of ~6 tokens, some of one token (an EOD after an EOD)
        rows.append(row)
    return rows


@pytest.mark.parametrize("per_token", [False, True], ids=["megatron-default", "calculate-per-token-loss"])
def test_a_packed_batch_equals_its_documents_run_one_by_one_through_hf_llama(per_token):
    """Two microbatches of two packed samples through ptdp's Llama (imported from HF's random weights) with
    the three flags: every position's loss equals HF's on that position's document alone, and the gradient
    of the step's loss (Megatron's default normalisation, or one mean over all unmasked tokens) equals the
    gradient of the same sum over HF's document-by-document losses."""
    from ptdp.data.documents import DocumentOptions
    from ptdp.models.llama.hf import from_hf_state
    from ptdp.parallel import ParallelDims, ParallelState
    from ptdp.parallel.assembly import stage_loss
    from ptdp.train.batches import BatchFormat, Microbatches

    hf, ours, cfg = tiny_hf_llama_and_ours(256, 64)
    s, m = 32, 2
    rows = _packed_rows(4, s, seed=5)
    fmt = BatchFormat(4, 2, DocumentOptions(EOD, True, True, True), PerDocument(), per_token)
    batches = Microbatches(_Samples(rows), 0, fmt, ParallelState(ParallelDims(1, 1, 1, 1), 0, torch.device("cpu")), m)
    batches.begin()
    total = torch.zeros(())
    for j in range(m):
        per_token_loss = F.cross_entropy(ours(batches.inputs(j), **batches.extras(j)).flatten(0, 1),
                                         batches.labels(j).flatten(), reduction="none").view(2, s)
        loss = stage_loss(ours(batches.inputs(j), **batches.extras(j)), batches.labels(j), batches.loss_weights(j))
        total = total + loss / m
        # the reference: each document of each sample alone through HF
        with torch.no_grad():
            for i, row in enumerate(rows[2 * j:2 * j + 2]):
                for a, e in zip(batches.extras(j)["documents"].bounds[i][:-1], batches.extras(j)["documents"].bounds[i][1:]):
                    logits = hf(torch.from_numpy(row[a:e])[None]).logits[0]
                    want = F.cross_entropy(logits, torch.from_numpy(row[a + 1:e + 1]), reduction="none")
                    torch.testing.assert_close(per_token_loss[i, a:e].detach(), want, rtol=1e-5, atol=1e-5)
    total.backward()

    # HF's loss: the same normalisation over its per-document losses
    reference = torch.zeros(())
    masks = [loss_mask(r[:-1], EOD) for r in rows]
    for j in range(m):
        mb = [], []
        for i in range(2 * j, 2 * j + 2):
            row = rows[i]
            for a, e in zip(cu_seqlens(row[:-1], EOD)[:-1], cu_seqlens(row[:-1], EOD)[1:]):
                logits = hf(torch.from_numpy(row[a:e])[None]).logits[0]
                ce = F.cross_entropy(logits, torch.from_numpy(row[a + 1:e + 1]), reduction="none")
                mb[0].append((ce * torch.from_numpy(masks[i][a:e])).sum())
        count = sum(masks[i].sum() for i in range(2 * j, 2 * j + 2))
        reference = reference + (sum(mb[0]) / (sum(m_.sum() for m_ in masks) if per_token else count * m))
    reference.backward()
    torch.testing.assert_close(total.detach(), reference.detach(), rtol=1e-5, atol=1e-6)
    want = from_hf_state({k: p.grad for k, p in hf.named_parameters()}, cfg)
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-6, msg=lambda msg, n=name: f"{n}: {msg}")


def test_without_the_flags_the_packed_sample_is_one_causal_window():
    """The control: the same model without a layout sees across documents (its losses differ from HF's
    per-document ones), so the comparison above can fail."""
    hf, ours, _ = tiny_hf_llama_and_ours(256, 64)
    row = _packed_rows(1, 32, seed=5)[0]
    bounds = cu_seqlens(row[:-1], EOD)
    a, e = bounds[1], bounds[2]  # the second document: it follows another one
    with torch.no_grad():
        plain = ours(torch.from_numpy(row[:-1])[None])[0, a:e]
        packed = ours(torch.from_numpy(row[:-1])[None], DocumentLayout([bounds], torch.from_numpy(positions(bounds))[None],
                                                                       PerDocument()))[0, a:e]
        alone = hf(torch.from_numpy(row[a:e])[None]).logits[0]
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain, alone, atol=1e-3)


def test_the_flex_block_mask_is_megatrons_mask():
    """FlexAttention cannot train on the CPU, but its block mask can be checked here: eager flex_attention's
    forward under it equals SDPA under Megatron's mask, and fully masked blocks are skipped."""
    from torch.nn.attention.flex_attention import flex_attention

    from ptdp.ops.document_attention import flex_block_mask

    rows = [random_tokens(1024, seed, mean_doc=40.0) for seed in (7, 8)]
    bounds = [cu_seqlens(r, EOD) for r in rows]
    mask = torch.from_numpy(np.stack([megatron_masks(r, EOD)[0] for r in rows]))[:, None]
    q, k, v = (x.detach().float() for x in _qkv(2, 2, 1024, 16))
    block_mask = flex_block_mask(bounds, 1024, torch.device("cpu"))
    with torch.no_grad():
        got = flex_attention(q, k, v, block_mask=block_mask)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=1e-5, atol=1e-5)
    assert block_mask.sparsity() > 70.0  # percent of 128 x 128 blocks never computed (causal alone: 43.75%)
