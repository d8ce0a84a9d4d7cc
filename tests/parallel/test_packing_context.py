"""Context-parallel attention over packed documents (ptdp.parallel.context.documents).

The pieces each rank computes cover exactly the document-causal pairs of one process, once (pure); ring,
all-gather and Ulysses attention over documents equal single-process SDPA under Megatron's mask, forward
and backward, on real gloo ranks; the document ring's calls are the plain ring's and pass the NCCL model.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import pooled_spawn
from test_context_parallel_attention import _receive_first, _record_p2p

from ptdp.data.documents import cu_seqlens
from ptdp.ops.document_attention import PerDocument, dense_mask
from ptdp.parallel.context.documents import chunk_segments, pieces

EOD = 9


def _bounds(s: int, seed: int) -> tuple[int, ...]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, EOD, s)
    tokens[rng.random(s) < 0.2] = EOD
    return cu_seqlens(tokens, EOD)


@pytest.mark.parametrize("c", [1, 2, 4])
@pytest.mark.parametrize("seed", range(5))
def test_pieces_cover_the_document_mask_exactly_once(c, seed):
    s = 48
    bounds = _bounds(s, seed) if seed else (0, 7, 8, 9, s)  # one-token documents at chunk edges
    covered = np.zeros((s, s), dtype=int)
    for r in range(c):
        mine = chunk_segments(s, c, r)
        local = np.concatenate([np.arange(a, b) for a, b in mine])
        for src in range(c):
            theirs = chunk_segments(s, c, src)
            keys = np.concatenate([np.arange(a, b) for a, b in theirs])
            for qa, qb, ka, kb, causal in pieces(bounds, mine, theirs):
                for i in range(qa, qb):
                    for j in range(ka, kb):
                        if not causal or j - ka <= i - qa:
                            covered[local[i], keys[j]] += 1
    want = dense_mask([bounds], s, torch.device("cpu"))[0, 0].numpy()
    assert covered.max() == 1
    np.testing.assert_array_equal(covered.astype(bool), want)


CASES = [(2, 4, 4, 32, 8), (1, 4, 2, 64, 16)]  # (b, heads, kv heads, s, d): MHA, and GQA unrepeated


def _check(rank: int, c: int, out: str) -> None:
    from ptdp.models.documents import DocumentLayout
    from ptdp.parallel.context.attention import shard_sequence
    from ptdp.parallel.context.documents import document_context_attention

    group = dist.group.WORLD
    for n, (b, heads, kv, s, d) in enumerate(CASES):
        g = torch.Generator().manual_seed(n)
        q = torch.randn(b, heads, s, d, generator=g)
        k, v = torch.randn(2, b, kv, s, d, generator=g).unbind(0)
        dout = torch.randn(b, heads, s, d, generator=g)
        bounds = [_bounds(s, 10 * n + i) for i in range(b)]
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        rep = heads // kv
        want = F.scaled_dot_product_attention(full[0], full[1].repeat_interleave(rep, 1),
                                              full[2].repeat_interleave(rep, 1),
                                              attn_mask=dense_mask(bounds, s, q.device))
        want.backward(dout)
        expected = [shard_sequence(t, c, rank, dim=2) for t in (want.detach(), *(x.grad for x in full))]
        for comm_type in ("p2p", "allgather", "a2a"):
            local = [shard_sequence(t, c, rank, dim=2).requires_grad_() for t in (q, k, v)]
            layout = DocumentLayout(bounds, None, PerDocument())
            got = document_context_attention(*local, layout, cp_group=group, comm_type=comm_type)
            got.backward(shard_sequence(dout, c, rank, dim=2))
            for name, x, y in zip(("out", "dq", "dk", "dv"), [got.detach()] + [t.grad for t in local], expected):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=2e-6,
                                           msg=lambda m, nm=name, t=comm_type, i=n: f"{t} case {i} {nm}: {m}")
    events: list[dict] = []
    original = dist.batch_isend_irecv
    dist.batch_isend_irecv = _record_p2p(events)
    try:
        b, heads, kv, s, d = CASES[0]
        local = [torch.randn(b, h, s // c, d, requires_grad=True) for h in (heads, kv, kv)]
        layout = DocumentLayout([_bounds(s, i) for i in range(b)], None, PerDocument())
        document_context_attention(*local, layout, cp_group=group, comm_type="p2p").sum().backward()
    finally:
        dist.batch_isend_irecv = original
    with open(f"{out}.{rank}", "w") as f:
        json.dump(events, f)


def test_ring_allgather_and_ulysses_over_documents_equal_one_process(tmp_path):
    from ptdp.simulate.nccl.model import check_all_send_models, check_trace

    c = 2
    pooled_spawn(_check, c, tmp_path, str(tmp_path / "trace"))
    trace = {"p": c, "v": 1, "ranks": [json.loads((tmp_path / f"trace.{r}").read_text()) for r in range(c)]}
    issues = [sum("issue" in e for e in events) for events in trace["ranks"]]
    assert issues == [2 * (c - 1) + c] * c  # the plain ring's exchanges, call for call
    for model, problems in check_all_send_models(trace).items():
        assert not problems, f"{model}: {problems[:3]}"
    assert any(p.startswith("deadlock") for p in check_trace(_receive_first(trace), sends_wait_for_receive=True))


def test_the_per_token_loss_count_is_deadlock_free_under_nccl_with_zero3_and_the_vocabulary_passes():
    """--calculate-per-token-loss: the count's all-reduce before every step, on the data-parallel
    communicator that ZeRO-3's collectives (and the vocabulary barriers' pipelines) share, in the schedules."""
    from ptdp.simulate.nccl.loss_tokens import with_token_count
    from ptdp.simulate.nccl.model import check_all_send_models, check_trace
    from ptdp.simulate.nccl.zero import record_zero_trace

    for name, p, v, m, barriers in [("1f1b", 2, 1, 4, 0), ("interleaved", 2, 2, 4, 0), ("zbv", 2, 2, 4, 0),
                                    ("1f1b", 2, 1, 4, 1), ("1f1b", 4, 1, 8, 2)]:
        for forward_only in (False, True):
            trace = with_token_count(record_zero_trace(name, p, v, m, replicas=2, forward_only=forward_only,
                                                       vocab_barriers=barriers), p, 2)
            for model, problems in check_all_send_models(trace).items():
                assert not problems, f"{name} p={p} v={v} barriers={barriers} ({model}): {problems[:3]}"
    # the check can fail: one replica that counts only after its schedule hangs its data-parallel peer
    trace = with_token_count(record_zero_trace("1f1b", 2, 1, 4, replicas=2), 2, 2)
    late = trace["ranks"][3]
    late.append(late.pop(0))
    assert any("deadlock" in p or "mismatch" in p for p in check_trace(trace, sends_wait_for_receive=False))
