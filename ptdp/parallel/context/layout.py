"""The load-balanced layout of context parallelism: the sequence in 2c chunks, CP rank i holding chunks i
and 2c-1-i (``ptdp.parallel.context.attention`` says why), and the positions, shards, orders and masks
derived from it. Kept apart from the attention so that each stays one short module."""

from __future__ import annotations

import functools

import torch


def load_balanced_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two of 2c sequence chunks this rank holds: (cp_rank, 2*cp_size-1-cp_rank)."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is not in [0, {cp_size})")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def _chunk_length(seq_length: int, cp_size: int) -> int:
    if seq_length % (2 * cp_size):
        raise ValueError(f"--seq-length {seq_length} does not split into 2 x --context-parallel-size "
                         f"= {2 * cp_size} equal chunks")
    return seq_length // (2 * cp_size)


def load_balanced_positions(seq_length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """LongTensor [seq_length // cp_size]: the real token positions this rank holds (its two chunks, in order)."""
    n = _chunk_length(seq_length, cp_size)
    first, second = load_balanced_chunks(cp_size, cp_rank)
    return torch.cat([torch.arange(first * n, (first + 1) * n, device=device),
                      torch.arange(second * n, (second + 1) * n, device=device)])


def shard_sequence(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of a full-sequence tensor along `dim`, concatenated (contiguous copy)."""
    n = _chunk_length(x.shape[dim], cp_size)
    first, second = load_balanced_chunks(cp_size, cp_rank)
    return torch.cat([x.narrow(dim, first * n, n), x.narrow(dim, second * n, n)], dim=dim)


@functools.lru_cache(maxsize=32)
def natural_order(cp_size: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Index into the rank-major concatenation of every rank's shard giving the natural token order, and
    its inverse. Built once per (c, chunk, device) and kept on the device: no host-to-device copy per layer."""
    held = torch.cat([load_balanced_positions(2 * cp_size * n, cp_size, r) for r in range(cp_size)])
    order = torch.argsort(held)
    return order.to(device), torch.argsort(order).to(device)


@functools.lru_cache(maxsize=32)
def allgather_mask(seq_length: int, cp_size: int, cp_rank: int, device: torch.device) -> torch.Tensor:
    """[s/c, s] bool, True = attend: this rank's queries against the rank-major gathered keys. Built once
    per (s, c, rank, device) on the device."""
    q_pos = load_balanced_positions(seq_length, cp_size, cp_rank)
    k_pos = torch.cat([load_balanced_positions(seq_length, cp_size, i) for i in range(cp_size)])
    return (q_pos[:, None] >= k_pos[None, :]).to(device)
