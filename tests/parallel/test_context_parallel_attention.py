"""Context-parallel attention equals one process's causal SDPA, and the ring cannot deadlock under NCCL.

Every comm type (p2p ring, a2a Ulysses, allgather) runs on c = 2 and c = 4 real gloo processes on the
same random inputs as a full-sequence ``F.scaled_dot_product_attention(is_causal=True)`` in each process;
each rank's output and its shards of dq, dk, dv must equal the reference's shards at fp32 tolerance at
every position (so a wrong mask or a wrong log-sum-exp merge fails on the chunks after the first). The
ring's real ``batch_isend_irecv`` calls are recorded and played through the NCCL model of
``ptdp.simulate.nccl.model``; variants of the same calls posted unsafely must fail it.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import pooled_spawn

import ptdp.parallel.context.attention as cp
from ptdp.parallel.context.attention import (
    context_parallel_attention,
    load_balanced_chunks,
    load_balanced_positions,
    shard_sequence,
)

# (batch, heads, kv_heads, seq, head_dim): a small case, a long one (s=256), grouped-query attention
# (b, heads, kv_heads, s, d, d_v): the last, multi-latent attention's narrower values
CASES = [(2, 4, 4, 16, 8, 8), (1, 4, 4, 256, 16, 16), (2, 4, 2, 32, 8, 8), (2, 4, 4, 16, 12, 8)]
COMM_TYPES = ["p2p", "a2a", "allgather"]


# ------------------------------------------------------------------------------------------- layout


def test_positions_and_chunks():
    assert load_balanced_chunks(4, 1) == (1, 6)
    assert load_balanced_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert load_balanced_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    every = torch.cat([load_balanced_positions(24, 3, r) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))  # a partition of the sequence
    assert load_balanced_positions(8, 1, 0).tolist() == list(range(8))
    with pytest.raises(ValueError, match="--context-parallel-size"):
        load_balanced_positions(12, 4, 0)


def test_shard_sequence_takes_the_positions_chunks():
    x = torch.randn(2, 24, 3)
    for r in range(3):
        shard = shard_sequence(x, 3, r)
        assert shard.is_contiguous() and shard.shape == (2, 8, 3)
        assert torch.equal(shard, x[:, load_balanced_positions(24, 3, r)])
    assert torch.equal(shard_sequence(x.transpose(0, 1), 2, 1, dim=0), x.transpose(0, 1)[6:18])


def test_without_a_group_it_is_causal_sdpa():
    q, k, v = torch.randn(3, 2, 4, 8, 8).unbind(0)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = context_parallel_attention(q, k, v, cp_group=None, comm_type="p2p")
    torch.testing.assert_close(got, want)


# ------------------------------------------------------------------------------------------- equivalence


def _inputs(b: int, heads: int, kv_heads: int, s: int, d: int, dv: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, s, d, generator=g)
    k, v = torch.randn(b, kv_heads, s, d, generator=g), torch.randn(b, kv_heads, s, dv, generator=g)
    dout = torch.randn(b, heads, s, dv, generator=g)
    return q, k, v, dout


def _reference(q, k, v, dout):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                         is_causal=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _record_p2p(events: list[dict]):
    """Wrap ``dist.batch_isend_irecv``: each call becomes an ``issue`` event of the NCCL model's trace
    (msg: [dtype, issue index, numel]: the n-th message on a channel must be sent by the sender's issue n
    and received by the receiver's issue n), each ``wait`` on its works a ``wait`` event."""
    real = dist.batch_isend_irecv

    class Work:
        def __init__(self, work, index):
            self.work, self.index = work, index

        def wait(self):
            events.append({"wait": self.index})
            return self.work.wait()

    def batch(ops):
        index = sum("issue" in e for e in events)
        events.append({"issue": [{"op": "send" if op.op is dist.isend else "recv", "peer": op.peer,
                                  "msg": [str(op.tensor.dtype), index, op.tensor.numel()]} for op in ops]})
        return [Work(w, index) for w in real(ops)]

    return batch


def _check_against_sdpa(rank: int, c: int, out: str) -> None:
    group = dist.group.WORLD
    for case_index, case in enumerate(CASES):
        q, k, v, dout = _inputs(*case, seed=case_index)
        want = [shard_sequence(t, c, rank, dim=2) for t in _reference(q, k, v, dout)]
        for comm_type in [*COMM_TYPES, "p2p-explicit"]:  # the ring's portable (non-CPU) block math too
            flash = cp._CPU_FLASH, cp._CPU_FLASH_BACKWARD
            if comm_type == "p2p-explicit":
                cp._CPU_FLASH = cp._CPU_FLASH_BACKWARD = None
            try:
                local = [shard_sequence(t, c, rank, dim=2).requires_grad_() for t in (q, k, v)]
                got = context_parallel_attention(*local, cp_group=group, comm_type=comm_type.split("-")[0])
                got.backward(shard_sequence(dout, c, rank, dim=2))
            finally:
                cp._CPU_FLASH, cp._CPU_FLASH_BACKWARD = flash
            for name, x, y in zip(("out", "dq", "dk", "dv"), [got.detach()] + [t.grad for t in local], want):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=2e-6,
                                           msg=lambda m, n=name, t=comm_type, i=case_index: f"{t} case {i} {n}: {m}")
    # the ring's calls, recorded on a run of its own (forward and backward)
    events: list[dict] = []
    original = dist.batch_isend_irecv
    dist.batch_isend_irecv = _record_p2p(events)
    try:
        local = [shard_sequence(t, c, rank, dim=2).requires_grad_() for t in _inputs(*CASES[0], seed=0)[:3]]
        context_parallel_attention(*local, cp_group=group, comm_type="p2p").sum().backward()
    finally:
        dist.batch_isend_irecv = original
    with pytest.raises(ValueError, match="--cp-comm-type a2a.*--context-parallel-size"):
        q, k, v = (x[:, :c - 1] for x in local)  # c - 1 heads: not divisible by c
        context_parallel_attention(q, k, v, cp_group=group, comm_type="a2a")
    with open(f"{out}.{rank}", "w") as f:
        json.dump(events, f)


@pytest.mark.parametrize("c", [2, 4])
def test_every_comm_type_matches_single_process_sdpa(tmp_path, c):
    from ptdp.simulate.nccl.model import check_all_send_models, check_trace  # not in the spawned ranks

    pooled_spawn(_check_against_sdpa, c, tmp_path, str(tmp_path / "trace"))
    trace = {"p": c, "v": 1, "ranks": [json.loads((tmp_path / f"trace.{r}").read_text()) for r in range(c)]}
    issues = [sum("issue" in e for e in events) for events in trace["ranks"]]
    assert issues == [2 * (c - 1) + c] * c  # forward: c-1 K/V hops; backward: c-1 K/V and c dK/dV hops
    for model, problems in check_all_send_models(trace).items():
        assert not problems, f"{model}: {problems[:3]}"
    for unsafe in (_receive_first(trace), _sends_then_receives(trace)):
        problems = check_trace(unsafe, sends_wait_for_receive=True)
        assert any(p.startswith("deadlock") for p in problems), problems


# ------------------------------------------------------------------------------------------- the check can fail


def _split_issues(trace: dict, order: tuple[str, str]) -> dict:
    """The same calls, each batch split into two issues: its ``order[0]`` ops, then its ``order[1]`` ops."""
    ranks = []
    for events in trace["ranks"]:
        new, where, count = [], {}, 0
        for e in events:
            if "issue" in e:
                where[len(where)] = count + 1
                for kind in order:
                    new.append({"issue": [op for op in e["issue"] if op["op"] == kind]})
                count += 2
            else:
                new.append({"wait": where[e["wait"]]})
        ranks.append(new)
    return {**trace, "ranks": ranks}


def _receive_first(trace: dict) -> dict:
    """Each receive posted in a batch of its own before the send: the receive of issue n blocks the
    rank's send of issue n+1 that its neighbour is waiting for: a hang whatever sends do."""
    return _split_issues(trace, ("recv", "send"))


def _sends_then_receives(trace: dict) -> dict:
    """Each send in a batch of its own before the receive: hangs once a send waits for its receive."""
    return _split_issues(trace, ("send", "recv"))


# ------------------------------------------------------------------------------------------- the flash merge


def _ring_in_one_process(q, k, v, dout, c: int, dtype=None):
    """The ring's per-block flash calls and LSE merge for all c ranks, played in one process (no
    communication): each rank's merged output, and dq/dk/dv summed from every block's flash backward."""
    from ptdp.parallel.context.attention import (
        _block,
        block_backward,
        block_forward,
        merge_block,
        shard_sequence,
    )

    s = q.shape[2]
    n = s // (2 * c)
    shard = [tuple(shard_sequence(x, c, r, dim=2) for x in (q, k, v, dout)) for r in range(c)]
    cast = (lambda x: x.to(dtype)) if dtype is not None else (lambda x: x)
    outs, grads = [], {r: [torch.zeros(x.shape) for x in shard[r][:3]] for r in range(c)}
    for r in range(c):
        qr = shard[r][0]
        out = torch.zeros(qr.shape, device=q.device)
        lse = torch.full(qr.shape[:-1], float("-inf"), device=q.device)
        for src in range(c):
            rows, cols, causal = _block(r, src, n)
            b_out, b_lse = block_forward(cast(qr[:, :, rows]), cast(shard[src][1][:, :, cols]),
                                         cast(shard[src][2][:, :, cols]), 0.125, causal)
            merge_block(out[:, :, rows], lse[:, :, rows], b_out, b_lse)
        outs.append(out)
        for src in range(c):
            rows, cols, causal = _block(r, src, n)
            dq, dk, dv = block_backward(cast(shard[r][3][:, :, rows]), cast(qr[:, :, rows]),
                                        cast(shard[src][1][:, :, cols]), cast(shard[src][2][:, :, cols]),
                                        out[:, :, rows], lse[:, :, rows], 0.125, causal)
            grads[r][0][:, :, rows] += dq.float().cpu()
            grads[src][1][:, :, cols] += dk.float().cpu()
            grads[src][2][:, :, cols] += dv.float().cpu()
    return outs, grads


@pytest.mark.parametrize("kernel", ["cpu-flash", "math"])
@pytest.mark.parametrize("c", [2, 4])
def test_flash_blocks_merged_by_lse_equal_full_attention(monkeypatch, kernel, c):
    """The ring's math (one flash call per block returning its LSE, blocks merged by the LSE, the
    backward per block from the merged output and LSE) against one full causal SDPA, on the CPU, with
    the CPU flash kernel and with the explicit fallback."""
    import ptdp.parallel.context.attention as cp
    from ptdp.parallel.context.attention import shard_sequence

    monkeypatch.setattr(cp, "block_kernel", lambda q: kernel)
    q, k, v, dout = (torch.randn(2, 4, 16 * c, 8, generator=torch.Generator().manual_seed(i)) for i in range(4))
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True, scale=0.125)
    ref.backward(dout)
    outs, grads = _ring_in_one_process(q, k, v, dout, c)
    for r in range(c):
        torch.testing.assert_close(outs[r], shard_sequence(ref.detach(), c, r, dim=2), rtol=1e-5, atol=1e-5)
        for got, x in zip(grads[r], full, strict=True):
            torch.testing.assert_close(got, shard_sequence(x.grad, c, r, dim=2), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU tier)")
def test_cuda_flash_blocks_merged_by_lse_equal_full_attention():
    """The same on a GPU with FlashAttention-2 blocks in bf16 (``block_kernel`` == "cuda-flash"), against
    fp32 full attention: bf16 tolerances."""
    from ptdp.parallel.context.attention import block_kernel, shard_sequence

    c = 4
    q, k, v, dout = (torch.randn(2, 4, 64 * c, 64, generator=torch.Generator().manual_seed(i)).cuda()
                     for i in range(4))
    assert block_kernel(q.bfloat16()) == "cuda-flash"
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True, scale=0.125)
    ref.backward(dout)
    outs, grads = _ring_in_one_process(q, k, v, dout, c, dtype=torch.bfloat16)
    for r in range(c):
        torch.testing.assert_close(outs[r], shard_sequence(ref.detach(), c, r, dim=2), rtol=2e-2, atol=2e-2)
        for got, x in zip(grads[r], full, strict=True):
            torch.testing.assert_close(got.cuda(), shard_sequence(x.grad, c, r, dim=2), rtol=5e-2, atol=5e-2)
