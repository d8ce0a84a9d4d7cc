"""The gated delta rule (Yang, Kautz and Hatamizadeh, 2024), the recurrence of a Gated DeltaNet layer, in plain
PyTorch: the token-by-token reference and the chunked form training runs.

Per head, with a state ``S`` of ``[K, V]`` (K the key width, V the value width), token t with query q, key k
(both L2-normalised, q also scaled by 1/√K), value v, decay g <= 0 (log space) and write strength β in (0, 1):

    S ← exp(g)·S;   S ← S + β·k·(v - Sᵀk)ᵀ;   o = Sᵀq

The chunked form (the WY/UT representation of the products of Householder-like factors) handles C tokens at
once with matrix products: inside a chunk with cumulative log decay Γ_i = g_1 + ... + g_i, the lower-
triangular system T = (I + strictly-lower((βK Kᵀ) ⊙ e^{Γ_i - Γ_j}))⁻¹ turns the C sequential updates into
U = T·βV and W = T·(βK ⊙ e^Γ); then, for the incoming state S,

    V' = U - W·S;   O = (Q ⊙ e^Γ)·S + ((Q Kᵀ) ⊙ e^{Γ_i - Γ_j}, causal)·V';   S_out = e^{Γ_C}·S + (K ⊙ e^{Γ_C - Γ})ᵀ·V'

which is affine in S: S_out = A·S + B with A = e^{Γ_C}·I - K̃ᵀW (``[K, K]``) and B = K̃ᵀU (``[K, V]``). A
whole sequence shard is then one (A, B) pair whatever its length (:func:`summary`), which is what context
parallelism's state passing exchanges (``ptdp.parallel.context.linear``).

Shapes: q, k ``[b, H, s, K]``, v ``[b, H, s, V]``, g, β ``[b, H, s]``; the state ``[b, H, K, V]``. The
arithmetic runs in fp32 (fp64 stays fp64), the output is cast back to v's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(Σx² + eps)`` over the last dimension (the q/k normalisation of Qwen3-Next and of
    flash-linear-attention)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule token by token: (outputs ``[b, H, s, V]``, final state). The reference the chunked form is
    tested against; too slow to train with."""
    dtype = _work_dtype(v)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    b, heads, s, dk = k.shape
    S = k.new_zeros(b, heads, dk, v.shape[-1]) if state is None else state.to(dtype)
    out = []
    for t in range(s):
        S = S * g[:, :, t].exp()[..., None, None]
        kt = k[:, :, t]
        delta = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", S, kt))
        S = S + kt[..., :, None] * delta[..., None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", S, q[:, :, t]))
    return torch.stack(out, 2), S


@dataclass
class Chunks:
    """A sequence's per-chunk quantities, computed once (``[b, H, n, C, ·]``): what the scan over chunks and
    the shard summary both read. ``length``: the unpadded sequence length."""

    qg: torch.Tensor  # Q ⊙ e^Γ: reads the incoming state
    attn: torch.Tensor  # (Q Kᵀ) ⊙ e^{Γ_i - Γ_j}, causal (diagonal included)
    u: torch.Tensor  # T·βV
    w: torch.Tensor  # T·(βK ⊙ e^Γ)
    kd: torch.Tensor  # K ⊙ e^{Γ_C - Γ}: writes the state at the chunk's end
    decay: torch.Tensor  # e^{Γ_C}, [b, H, n]
    length: int


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            chunk: int = 64) -> Chunks:
    """Cut the sequence into chunks of ``chunk`` tokens (the last padded with tokens that neither decay nor
    write: g = 0, β = 0, k = 0) and solve each chunk's triangular system."""
    dtype = _work_dtype(v)
    s = k.shape[2]
    pad = (-s) % chunk
    q, k, v = (F.pad(x.to(dtype), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.to(dtype), (0, pad)) for x in (g, beta))
    b, heads, padded, _ = k.shape
    q, k, v = (x.view(b, heads, padded // chunk, chunk, -1) for x in (q, k, v))
    g, beta = (x.view(b, heads, padded // chunk, chunk) for x in (g, beta))
    gamma = g.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()
    pairwise = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb = k * beta[..., None]
    system = (kb @ k.transpose(-1, -2)) * pairwise  # unit lower-triangular once its diagonal is read as 1
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * gamma.exp()[..., None], upper=False, unitriangular=True)
    last = gamma[..., -1:]
    return Chunks(qg=q * gamma.exp()[..., None], attn=(q @ k.transpose(-1, -2)) * pairwise, u=u, w=w,
                  kd=k * (last - gamma).exp()[..., None], decay=last[..., 0].exp(), length=s)


def scan(c: Chunks, state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs ``[b, H, s, V]`` and the final state from the incoming ``state`` (None: zero), chunk by
    chunk."""
    b, heads, _, _, dk = c.w.shape
    S = c.u.new_zeros(b, heads, dk, c.u.shape[-1]) if state is None else state.to(c.u.dtype)
    out = []
    for u, w, qg, attn, kd, decay in zip(*_per_chunk(c)):
        fresh = u - w @ S
        out.append(qg @ S + attn @ fresh)
        S = S * decay[..., None, None] + kd.transpose(-1, -2) @ fresh
    return torch.cat(out, 2)[:, :, :c.length], S


def _per_chunk(c: Chunks) -> tuple[tuple[torch.Tensor, ...], ...]:
    """Each chunk's tensors, cut once (``unbind``): indexing chunk i out of the whole tensor in a loop would
    make the backward write a full-size gradient per chunk, quadratic in s."""
    return tuple(x.unbind(2) for x in (c.u, c.w, c.qg, c.attn, c.kd, c.decay))


def summary(c: Chunks) -> tuple[torch.Tensor, torch.Tensor]:
    """(A ``[b, H, K, K]``, B ``[b, H, K, V]``): the whole sequence's final state is A·S + B for an incoming
    state S -- its size does not depend on the sequence length."""
    b, heads, _, _, dk = c.w.shape
    eye = torch.eye(dk, dtype=c.u.dtype, device=c.u.device)
    A = eye.expand(b, heads, dk, dk)
    B = c.u.new_zeros(b, heads, dk, c.u.shape[-1])
    for u, w, _, _, kd, decay in zip(*_per_chunk(c)):
        kt = kd.transpose(-1, -2)
        a_i = decay[..., None, None] * eye - kt @ w
        A, B = a_i @ A, a_i @ B + kt @ u
    return A, B


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor | None = None, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked rule: (outputs ``[b, H, s, V]`` in v's dtype, final state); equal to :func:`recurrent`."""
    out, final = scan(prepare(q, k, v, g, beta, chunk), state)
    return out.to(v.dtype), final
