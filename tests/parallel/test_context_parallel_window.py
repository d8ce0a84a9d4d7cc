"""Sliding windows and attention sinks under context parallelism equal one process, and a windowed layer
moves only the keys inside its windows.

Every comm type (p2p: the windowed exchange for a windowed layer, the ring with the sink merged for a full
one; a2a; allgather) runs on c = 2 and c = 4 real gloo processes on the same random inputs as the one-process
core (``ptdp.models.sinks``/``ptdp.models.window`` against a naive masked softmax): each rank's output and its
shards of dq, dk, dv and the sinks' gradient equal the reference's at fp32 tolerance; so do packed documents
cutting across the chunks with windows, sinks and capped scores (``ptdp.parallel.context.document_window``), and
capped scores without documents. The exchange plan sends
nothing a window does not reach: at w <= n a rank sends at most two tails of w - 1 tokens, whatever c and s.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import pooled_spawn

from ptdp.parallel.context.attention import context_parallel_attention, shard_sequence
from ptdp.parallel.context.window import exchange_plan, key_chunks, sent_tokens

# (b, heads, kv_heads, s, d, window, sinks): windows inside a chunk, across several chunks, beyond the
# sequence (a full layer), with and without sinks; grouped-query attention
CASES = [(2, 4, 2, 32, 8, 3, True), (1, 4, 4, 32, 8, 11, False), (2, 4, 2, 32, 8, None, True),
         (1, 4, 4, 48, 8, 20, True), (1, 4, 2, 32, 8, 64, False)]
COMM_TYPES = ["p2p", "a2a", "allgather"]
# (b, heads, kv_heads, s, d, window, sinks, softcap, bounds): packed documents cutting across the chunks (one
# of a single token, one longer than a chunk) with windows, sinks and capped scores; caps without documents
DOCUMENTS = [[0, 5, 6, 19, 27, 32], [0, 3, 32]]
DOC_CASES = [(2, 4, 2, 32, 8, 3, True, None, DOCUMENTS), (2, 4, 4, 32, 8, 11, False, 2.0, DOCUMENTS),
             (2, 4, 2, 32, 8, None, True, None, DOCUMENTS), (2, 4, 2, 32, 8, None, False, 2.0, DOCUMENTS),
             (1, 4, 2, 32, 8, None, True, 2.0, None), (1, 4, 4, 32, 8, 5, False, 2.0, None)]


def _reference(q, k, v, sinks, window, dout, softcap=None, bounds=None):
    """A naive masked softmax with one more logit per head (the sink's), and its gradients; ``softcap``:
    the scores capped first, ``bounds``: the document mask too."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    z = sinks.clone().requires_grad_() if sinks is not None else None
    groups = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q.shape[2]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = (j <= i) & (i - j < (window or s))
    if bounds is not None:
        same = torch.zeros(len(bounds), 1, s, s, dtype=torch.bool)
        for row, cu in enumerate(bounds):
            for a, e in zip(cu[:-1], cu[1:]):
                same[row, 0, a:e, a:e] = True
        allowed = allowed & same
    scores = q @ kk.transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if z is not None:
        scores = torch.cat([scores, z.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    probs = scores.softmax(-1)[..., :s]
    out = probs @ vv
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad, None if z is None else z.grad


def _check(rank: int, c: int, out: str) -> None:  # c: the world size
    group = dist.group.WORLD
    for index, (b, heads, kv, s, d, window, with_sinks) in enumerate(CASES):
        g = torch.Generator().manual_seed(index)
        q, k, v = torch.randn(b, heads, s, d, generator=g), *(torch.randn(b, kv, s, d, generator=g) for _ in "kv")
        sinks = torch.randn(heads, generator=g) if with_sinks else None
        dout = torch.randn(b, heads, s, d, generator=g)
        want = _reference(q, k, v, sinks, window, dout)
        for comm_type in COMM_TYPES:
            local = [shard_sequence(t, c, rank, dim=2).requires_grad_() for t in (q, k, v)]
            z = sinks.clone().requires_grad_() if sinks is not None else None
            got = context_parallel_attention(*local, cp_group=group, comm_type=comm_type, window=window, sinks=z)
            got.backward(shard_sequence(dout, c, rank, dim=2))
            what = f"case {index} {comm_type} rank {rank}"
            torch.testing.assert_close(got, shard_sequence(want[0], c, rank, dim=2), rtol=1e-5, atol=1e-5, msg=what)
            for name, t, ref in zip("qkv", local, want[1:4]):
                torch.testing.assert_close(t.grad, shard_sequence(ref, c, rank, dim=2), rtol=1e-4, atol=1e-5,
                                           msg=f"{what} d{name}")
            if z is not None:  # each rank's share of the sinks' gradient sums to the whole one
                total = z.grad.clone()
                dist.all_reduce(total, group=group)
                torch.testing.assert_close(total, want[4], rtol=1e-4, atol=1e-5, msg=f"{what} dsinks")
    _check_documents(rank, c, group)
    torch.save(True, f"{out}.{rank}")


def _check_documents(rank: int, c: int, group) -> None:
    """DOC_CASES: the packed documents' path (``ptdp.parallel.context.document_window``) and the capped
    scores without documents, each comm type against the naive reference, values and gradients."""
    from ptdp.models.documents import DocumentLayout
    from ptdp.ops.document_attention import PerDocument
    from ptdp.parallel.context.document_window import document_window_context_attention

    for index, (b, heads, kv, s, d, window, with_sinks, cap, bounds) in enumerate(DOC_CASES):
        g = torch.Generator().manual_seed(100 + index)
        q, k, v = torch.randn(b, heads, s, d, generator=g), *(torch.randn(b, kv, s, d, generator=g) for _ in "kv")
        sinks = torch.randn(heads, generator=g) if with_sinks else None
        dout = torch.randn(b, heads, s, d, generator=g)
        bounds = None if bounds is None else bounds[:b]
        want = _reference(q, k, v, sinks, window, dout, cap, bounds)
        for comm_type in COMM_TYPES:
            local = [shard_sequence(t, c, rank, dim=2).requires_grad_() for t in (q, k, v)]
            z = sinks.clone().requires_grad_() if sinks is not None else None
            if bounds is None:
                got = context_parallel_attention(*local, cp_group=group, comm_type=comm_type, window=window, sinks=z,
                                                 softcap=cap)
            else:
                got = document_window_context_attention(*local, DocumentLayout(bounds, None, PerDocument()),
                                                        cp_group=group, comm_type=comm_type, scale=None,
                                                        window=window, sinks=z, softcap=cap)
            got.backward(shard_sequence(dout, c, rank, dim=2))
            what = f"document case {index} {comm_type} rank {rank}"
            torch.testing.assert_close(got, shard_sequence(want[0], c, rank, dim=2), rtol=1e-5, atol=1e-5, msg=what)
            for name, t, ref in zip("qkv", local, want[1:4]):
                torch.testing.assert_close(t.grad, shard_sequence(ref, c, rank, dim=2), rtol=1e-4, atol=1e-5,
                                           msg=f"{what} d{name}")
            if z is not None:
                total = z.grad.clone()
                dist.all_reduce(total, group=group)
                torch.testing.assert_close(total, want[4], rtol=1e-4, atol=1e-5, msg=f"{what} dsinks")


@pytest.mark.parametrize("c", [2, 4])
def test_windows_and_sinks_under_context_parallelism_equal_one_process(tmp_path, c):
    pooled_spawn(_check, c, tmp_path, str(tmp_path / "ok"))
    assert all((tmp_path / f"ok.{r}").exists() for r in range(c))


def test_the_exchange_sends_only_the_tails_a_window_reaches():
    """w <= n: a query chunk sees its own chunk and the last w - 1 tokens of the one before; every rank sends at
    most two such tails, whatever c and s, and rank 0's first chunk (the sequence's start) needs nothing."""
    assert list(key_chunks(5, 8, 1)) == [5] and list(key_chunks(5, 8, 2)) == [4, 5]
    assert list(key_chunks(5, 8, 9)) == [4, 5] and list(key_chunks(5, 8, 10)) == [3, 4, 5]
    for c in (2, 4, 8):
        for n in (16, 64, 1024):  # s = 2cn grows; the tails do not
            assert max(sent_tokens(c, n, 16, r) for r in range(c)) == (15 if c == 2 else 2 * 15)
            # every chunk but the last sends its tail to its successor's rank, except chunk c-1 (its
            # successor is its own rank's other chunk)
            assert sum(sent_tokens(c, n, 16, r) for r in range(c)) == (2 * c - 2) * 15
        assert exchange_plan(c, 16, 16)[0] == ((), ((1, 1),), *[()] * (c - 2))  # chunk 2c-2 from its token 1
    # a window over the whole sequence: rank r needs every chunk before its second one but its own first, whole
    assert sum(sent_tokens(4, 4, 32, r) for r in range(4)) == 4 * sum(2 * 4 - 2 - r for r in range(4))
