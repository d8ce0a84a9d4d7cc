"""Context parallelism: causal attention over a sequence split across the c ranks of a CP group.

Layout (docs/references.md, §Context parallelism). The sequence is cut into 2c equal chunks
and CP rank i holds chunks i and 2c-1-i, concatenated in that order. Under a causal mask an early chunk
attends to few keys and a late one to many, so pairing them gives every rank the same work. Everything
outside attention is per-token and never notices the split; positions (learned or rotary) must follow
``load_balanced_positions``.

Three ways to attend over the whole sequence (Megatron's ``--cp-comm-type``):

* ``p2p`` (ring attention, Li et al.): K/V blocks travel around the ring; each rank attends its queries
  to each block as it passes, overlapping the transfer of the next block with the current block's math,
  and merges the partial outputs by their log-sum-exp (as flash attention merges tiles). The backward
  sends K/V around again, with their gradient accumulator following one step behind. Per-rank memory
  stays O(s/c): the blocks' probabilities are recomputed in the backward from the saved LSE.
* ``a2a`` (DeepSpeed Ulysses): an all-to-all turns sequence sharding into head sharding (every rank gets
  all s tokens of heads/c heads), plain causal attention runs, and a second all-to-all turns it back.
* ``allgather``: all-gather K/V, attend with a mask from the real positions; its backward reduce-scatters
  dK/dV. The simplest, O(s) memory per rank; the reference the other two are checked against.

Values may be narrower than q and k (MLA): K and V travel as one block; flash kernels pad V.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from ptdp.models.sinks import sink_attention
from ptdp.models.window import local_window_attention
from ptdp.parallel.collectives import gather_from_sequence_parallel_region, group_rank, group_size
from ptdp.parallel.context.layout import (  # noqa: F401  (the layout's names, re-exported)
    allgather_mask,
    load_balanced_chunks,
    load_balanced_positions,
    natural_order,
    shard_sequence,
)
from ptdp.parallel.context.ring import ring_backward, ring_forward
from ptdp.parallel.context.ulysses import head_sharded, repeat_kv
from ptdp.parallel.context.window import windowed_context_attention

COMM_TYPES = ("p2p", "a2a", "allgather")


# ------------------------------------------------------------------------------------------- entry point


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp_group,
                               comm_type: str, dropout_p: float = 0.0, softmax_scale: float | None = None,
                               window: int | None = None, sinks: torch.Tensor | None = None,
                               softcap: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence. q: [b, heads, s/c, d];
    k, v: [b, kv_heads, s/c, d] (kv_heads == heads after the caller's GQA repeat); all in the
    load-balanced layout above (chunk i then chunk 2c-1-i). Returns [b, heads, s/c, d] in the same layout.
    comm_type "p2p": ring attention; "a2a": Ulysses; "allgather": all-gather K/V then one masked attention.

    kv_heads may also be any divisor of heads (grouped-query attention without the repeat: the ring then
    sends the unrepeated K/V); v may be narrower. With c = 1 (``cp_group`` None or of one rank) this is SDPA.
    ``window``: a sliding window (p2p: ``ptdp.parallel.context.window``'s exchange of the chunks inside it
    instead of the ring); ``sinks [heads]``: one more logit per head in the softmax (``ptdp.models.sinks``).
    ``softcap`` (``--attn-logit-softcapping``): the scores capped before the softmax; the flash blocks cannot
    cap, so a capped layer takes the windowed paths with a window of the whole sequence (exact; the keys it
    holds at once are O(s), as all-gather's).
    """
    c = group_size(cp_group)
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key/value heads")
    if window is not None and window >= q.shape[2] * c:  # the window holds the whole sequence
        window = None
    if softcap is not None and window is None:  # explicit scores: the tiles of a whole-sequence window
        window = q.shape[2] * c
    if c == 1:
        k, v = repeat_kv(k, v, heads // kv_heads)
        if window is not None or sinks is not None:
            return _local(q, k, v, softmax_scale, window, sinks, dropout_p, softcap=softcap)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=softmax_scale)
    if comm_type not in COMM_TYPES:
        raise ValueError(f"--cp-comm-type {comm_type!r} is not one of {', '.join(COMM_TYPES)}")
    if dropout_p > 0.0:  # every layout would need the single process's mask for the same numbers
        raise ValueError("--attention-dropout > 0 is not supported with --context-parallel-size > 1")
    if q.shape[2] % 2:
        raise ValueError(f"the local sequence {q.shape[2]} is not two equal chunks: --seq-length must be a "
                         f"multiple of 2 x --context-parallel-size = {2 * c}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if comm_type == "a2a":  # this rank's heads/c heads: their sinks
        if window is None and sinks is None:
            return head_sharded(q, k, v, cp_group, functools.partial(F.scaled_dot_product_attention, is_causal=True,
                                                                     scale=scale))
        sinks = None if sinks is None else sinks.chunk(c)[group_rank(cp_group)]
        return head_sharded(q, k, v, cp_group, functools.partial(_local, scale=scale, window=window, sinks=sinks,
                                                                 softcap=softcap))
    if comm_type == "allgather":
        return _allgather_attention(q, k, v, cp_group, scale, window, sinks, softcap)
    if window is not None:
        return windowed_context_attention(q, k, v, cp_group, scale, window, sinks, softcap)
    return _RingAttention.apply(q, k, v, cp_group, scale, sinks)


def _local(q, k, v, scale, window: int | None, sinks: torch.Tensor | None, dropout_p: float = 0.0, *,
           q_start: int = 0, softcap: float | None = None) -> torch.Tensor:
    """Attention over whole keys from position 0 (queries from ``q_start``): windowed tiles (capped with
    ``softcap``: the caller gives a window then), or the causal softmax with the sinks."""
    if window is not None:
        return local_window_attention(q, k, v, window, q_start=q_start, scale=scale, sinks=sinks, dropout_p=dropout_p,
                                      softcap=softcap)
    allowed = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(q_start)
    return sink_attention(q, k, v, sinks, allowed, dropout_p, scale)


# ------------------------------------------------------------------------------------------- allgather


def _allgather_attention(q, k, v, group, scale: float, window: int | None = None,
                         sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    c, r = group_size(group), group_rank(group)
    s = q.shape[2] * c
    k, v = repeat_kv(gather_from_sequence_parallel_region(k, group, dim=2),
                      gather_from_sequence_parallel_region(v, group, dim=2), q.shape[1] // k.shape[1])
    if window is not None:  # each query chunk over the natural-order keys, in tiles of its window
        order, _ = natural_order(c, q.shape[2] // 2, q.device)
        k, v = k.index_select(2, order), v.index_select(2, order)
        n = q.shape[2] // 2
        return torch.cat([_local(q[:, :, i * n:(i + 1) * n], k, v, scale, window, sinks, q_start=chunk * n,
                                 softcap=softcap)
                          for i, chunk in enumerate(load_balanced_chunks(c, r))], dim=2)
    mask = allgather_mask(s, c, r, q.device)
    if sinks is not None:
        return sink_attention(q, k, v, sinks, mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


# ------------------------------------------------------------------------------------------- p2p (ring)


def _block(rank: int, src: int, n: int) -> tuple[slice, slice, bool]:
    """Which queries of this rank see which keys of rank ``src``'s block, and whether causally.

    This rank holds chunks (r, 2c-1-r), ``src`` holds (s, 2c-1-s). s == r: the diagonal, a causal mask on
    the local order (positions increase along it). s < r: chunk s precedes both query chunks and chunk
    2c-1-s follows both, so all queries see the first half of the keys, unmasked. s > r: both key chunks
    (s and 2c-1-s, each in [r+1, 2c-2-r]) follow chunk r and precede chunk 2c-1-r, so only the second
    half of the queries sees them, all of them. Every step but the diagonal is thus one unmasked
    (2n x n or n x 2n) product, the diagonal a causal 2n x 2n: equal work on every rank and step.
    """
    if src == rank:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, n), False
    return slice(n, None), slice(None), False


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_CUDA_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)
_CUDA_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_backward", None)


def block_kernel(q: torch.Tensor) -> str:
    """Which kernel computes one ring block: ``"cuda-flash"`` (FlashAttention-2 through torch's aten op,
    which returns the LSE: 16-bit inputs on a CUDA device of compute capability >= 8.0, head dim <= 256),
    ``"cpu-flash"`` (torch's CPU flash kernel, any float dtype) or ``"math"`` (explicit, exact, but it
    materialises the block's scores: the fallback, e.g. fp32 on a GPU)."""
    if q.device.type == "cpu" and _CPU_FLASH is not None:
        return "cpu-flash"
    if (q.device.type == "cuda" and _CUDA_FLASH is not None and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0 and torch.cuda.get_device_capability(q.device)[0] >= 8):
        return "cuda-flash"
    return "math"


def block_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype blocks are computed in: the input's for the CUDA flash kernel (it takes 16-bit only and
    accumulates in fp32 itself), fp32 otherwise. Merged outputs and LSEs are always fp32."""
    return q.dtype if block_kernel(q) == "cuda-flash" else torch.float32


def _no_rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (rng_state, unused) pair the CUDA flash forward returns, of the same types: dropout is off, so
    the backward never reads them (blocks are recomputed, their forward's pair is not kept)."""
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.zeros((), dtype=torch.uint64)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention output and its fp32 log-sum-exp [b, h, s_q], by ``block_kernel(q)``."""
    kernel = block_kernel(q)
    if kernel != "math" and v.shape[-1] != q.shape[-1]:  # values narrower than the keys: pad, then cut
        out, lse = block_forward(q, k, _pad_to(v, q.shape[-1]), scale, causal)
        return out[..., :v.shape[-1]], lse
    if kernel == "cpu-flash":
        return _CPU_FLASH(q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale)
    if kernel == "cuda-flash":
        out, lse = _CUDA_FLASH(q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, False, scale=scale)[:2]
        return out, lse.float()
    s = _scores(q, k, scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), v), lse


def _pad_to(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))  # the flash kernels' one head size


def block_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv of one block given the MERGED output and LSE: with them the flash-attention backward
    (P = exp(S - LSE), dS = P * (dO V^T - rowsum(dO * O))) yields exactly this block's share."""
    kernel = block_kernel(q)
    d, dv_size = q.shape[-1], v.shape[-1]
    if kernel != "math" and dv_size != d:  # as block_forward: the zero columns change nothing
        dq, dk, dv = block_backward(_pad_to(do, d), q, k, _pad_to(v, d), _pad_to(out, d), lse, scale, causal)
        return dq, dk, dv[..., :dv_size]
    if kernel == "cpu-flash":
        return _CPU_FLASH_BACKWARD(do.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
                                   out.contiguous(), lse.contiguous(), 0.0, causal, scale=scale)
    if kernel == "cuda-flash":
        return _CUDA_FLASH_BACKWARD(do.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
                                    out.to(q.dtype).contiguous(), lse.contiguous(), None, None, q.shape[2],
                                    k.shape[2], 0.0, causal, *_no_rng_state(q.device), scale=scale)[:3]
    p = torch.exp(_scores(q, k, scale, causal) - lse[..., None])
    ds = p * (torch.matmul(do, v.transpose(-1, -2)) - (do * out).sum(-1, keepdim=True))
    return (torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale,
            torch.matmul(p.transpose(-1, -2), do))


def merge_block(out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor) -> None:
    """Fold one block's (output, LSE) into the running fp32 (``out``, ``lse``) in place, as flash attention
    merges its tiles: new = logaddexp(lse, blk); out = out·e^(lse-new) + blk_out·e^(blk-new)."""
    new_lse = torch.logaddexp(lse, blk_lse)
    out.mul_(torch.exp(lse - new_lse)[..., None]).add_(blk_out.float() * torch.exp(blk_lse - new_lse)[..., None])
    lse.copy_(new_lse)


def merge_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Fold the sinks ``[heads]`` into the merged fp32 (``out``, ``lse``) as one more block, a logit per head
    with a zero value: ``out`` rescaled in place; returns the LSE that holds the sink."""
    with_sink = torch.logaddexp(lse, sinks.detach().float().view(1, -1, 1))
    out.mul_(torch.exp(lse - with_sink)[..., None])
    return with_sink


def sinks_grad(sinks: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """The sinks' gradient, given (``out``, ``lse``) that hold them (``merge_sinks``): the sink's value is 0,
    so it is -p_sink · rowsum(dO ∘ O), summed over the batch and the queries. With the sink in (out, lse) the
    blocks' own backward is already the sink-softmax's."""
    p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse)
    return (-(p_sink * (dout.float() * out).sum(-1)).sum((0, 2))).to(sinks.dtype)


def expand_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """One block's K or V heads repeated ``groups`` times (a ring block carries the unrepeated heads)."""
    return x if groups == 1 else x.repeat_interleave(groups, 1)


def fold_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of ``expand_heads``: sum each group's copies."""
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x.view(b, h // groups, groups, s, d).sum(2)


class _RingAttention(torch.autograd.Function):
    """Ring attention over the load-balanced layout. Each block is one flash-attention call that returns
    its LSE (``block_kernel``: FlashAttention-2 on a CUDA GPU in bf16/fp16, torch's flash kernel on the CPU;
    explicit math only as the fallback), and the blocks are merged by their LSE (``merge_block``) into an
    fp32 output: no (s/c)² score block is materialised, so per-rank activation memory is O(s/c). The
    backward recomputes each block from the merged output and LSE with the matching flash backward.

    NCCL safety (docs/references.md, §NCCL). Every transfer is one
    ``ring.ring_exchange``: a single ``batch_isend_irecv`` holding this rank's send to ring-next and its
    receive from ring-prev. Every rank posts the same sequence of exchanges (forward: c-1 K/V exchanges;
    backward: c-1 K/V exchanges interleaved with c dK/dV exchanges, in the same order on every rank), and
    the host posts exchange n+1 only after exchange n (it never waits on a later one). Each channel
    r -> r+1 carries exactly one message per exchange, so FIFO matching pairs the n-th send with the n-th
    receive. By induction on n: once every rank's exchange n-1 has completed, every rank's exchange n can
    start (the compute stream before it only waits on exchanges < n), every one of its sends finds its
    receive posted in the neighbour's exchange n and every receive its send, so all complete - even if a
    send waits for its receive. ``tests/parallel/test_context_parallel_attention.py`` records the real calls and
    plays them through ``ptdp.simulate.nccl.model.check_trace``.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, scale: float,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        r = group_rank(group)
        n, groups = q.shape[2] // 2, q.shape[1] // k.shape[1]
        dtype = block_dtype(q)
        qf = q.to(dtype)
        out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        sizes = [k.shape[-1], v.shape[-1]]

        def visit(src: int, kv: torch.Tensor) -> None:
            rows, cols, causal = _block(r, src, n)
            kb, vb = (expand_heads(x[:, :, cols].to(dtype), groups) for x in kv.split(sizes, dim=-1))
            blk_out, blk_lse = block_forward(qf[:, :, rows], kb, vb, scale, causal)
            merge_block(out[:, :, rows], lse[:, :, rows], blk_out, blk_lse)

        ring_forward(torch.cat([k, v], dim=-1), group, visit)  # one block on the wire, whatever the head sizes
        if sinks is not None:  # the sink joins the merged softmax as one more block
            lse = merge_sinks(out, lse, sinks)
        ctx.has_sinks = sinks is not None
        ctx.save_for_backward(q, k, v, out, lse, *(() if sinks is None else (sinks,)))
        ctx.group, ctx.scale = group, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse, *sinks = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        dsinks = sinks_grad(sinks[0], out, lse, dout) if sinks else None
        r = group_rank(group)
        n, groups = q.shape[2] // 2, q.shape[1] // k.shape[1]
        dtype = block_dtype(q)
        qf, do = q.to(dtype), dout.to(dtype)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        sizes = [k.shape[-1], v.shape[-1]]

        def visit(src: int, kv: torch.Tensor) -> torch.Tensor:
            rows, cols, causal = _block(r, src, n)
            kb, vb = (expand_heads(x[:, :, cols].to(dtype), groups) for x in kv.split(sizes, dim=-1))
            dq_b, dk_b, dv_b = block_backward(do[:, :, rows], qf[:, :, rows], kb, vb, out[:, :, rows],
                                               lse[:, :, rows], scale, causal)
            dq[:, :, rows] += dq_b
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            dkv[:, :, cols, :sizes[0]] = fold_heads(dk_b.float(), groups)
            dkv[:, :, cols, sizes[0]:] = fold_heads(dv_b.float(), groups)
            return dkv

        dk, dv = ring_backward(torch.cat([k, v], dim=-1), group, visit).split(sizes, dim=-1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, dsinks
