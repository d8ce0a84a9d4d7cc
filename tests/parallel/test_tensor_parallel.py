"""Each tensor-parallel layer against its dense counterpart, forward and backward, on real gloo ranks."""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import pooled_spawn

from ptdp.config import ModelConfig
from ptdp.models import GPTModel
from ptdp.parallel.init import init_parameters
from ptdp.parallel.placement import Placements
from ptdp.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_model_parallel_region,
    mask_padded_vocab,
    vocab_parallel_cross_entropy,
)
from ptdp.parallel.tensor.apply import apply_tensor_parallel

TOL = dict(rtol=1e-4, atol=1e-5)  # fp32: summation order differs across ranks


def _shard(full: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    return full.chunk(world, dim)[rank]


def _check_linears(rank: int, world: int, group) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8, requires_grad=True)
    w1, b1 = torch.randn(12, 8), torch.randn(12)
    w2, b2 = torch.randn(8, 12), torch.randn(8)
    dense = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    grad_out = torch.randn_like(dense)
    dense.backward(grad_out)
    dense_x_grad = x.grad.clone()
    w1, w2 = w1.requires_grad_(), w2.requires_grad_()
    dense2 = F.linear(F.gelu(F.linear(x.detach(), w1, b1)), w2, b2)
    dense2.backward(grad_out)

    col = ColumnParallelLinear(8, 12, tp_group=group)
    row = RowParallelLinear(12, 8, tp_group=group)
    with torch.no_grad():
        col.weight.copy_(_shard(w1.detach(), 0, rank, world))
        col.bias.copy_(_shard(b1, 0, rank, world))
        row.weight.copy_(_shard(w2.detach(), 1, rank, world))
        row.bias.copy_(b2)
    xp = x.detach().clone().requires_grad_()
    out = row(F.gelu(col(xp)))
    out.backward(grad_out)
    torch.testing.assert_close(out, dense, **TOL)
    torch.testing.assert_close(xp.grad, dense_x_grad, **TOL)
    torch.testing.assert_close(col.weight.grad, _shard(w1.grad, 0, rank, world), **TOL)
    torch.testing.assert_close(row.weight.grad, _shard(w2.grad, 1, rank, world), **TOL)


def _check_fused_qkv(rank: int, world: int, group) -> None:
    """A fused [3, h, h] column-parallel weight gives each rank its heads of q, k and v."""
    torch.manual_seed(1)
    x = torch.randn(3, 8)
    full = torch.randn(3, 8, 8)
    layer = ColumnParallelLinear(8, 8, tp_group=group, fused=3, bias=False)
    with torch.no_grad():
        layer.weight.copy_(_shard(full, 1, rank, world))
    q, k, v = (x @ full[i].T for i in range(3))
    expected = torch.cat([_shard(t, -1, rank, world) for t in (q, k, v)], dim=-1)
    torch.testing.assert_close(layer(x), expected, **TOL)


def _check_embedding_and_loss(rank: int, world: int, group) -> None:
    torch.manual_seed(2)
    vocab, padded, h = 10, 16, 4
    table = torch.randn(padded, h, requires_grad=True)
    ids = torch.tensor([[0, 3, 9, 7], [5, 1, 2, 8]])
    labels = torch.tensor([[3, 9, 7, 1], [1, 2, 8, 0]])
    hidden = F.embedding(ids, table)
    logits = (hidden @ table.T)[..., :vocab]  # the dense model never sees padding ids
    dense_loss = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))
    dense_loss.backward()

    emb = VocabParallelEmbedding(padded, h, tp_group=group)
    with torch.no_grad():
        emb.weight.copy_(_shard(table.detach(), 0, rank, world))
    hidden_p = emb(ids)
    torch.testing.assert_close(hidden_p, hidden, **TOL)
    head_input = copy_to_tensor_model_parallel_region(hidden_p, group)  # f: grads summed over ranks
    local_logits = mask_padded_vocab(head_input @ emb.weight.T, vocab, group)
    loss = vocab_parallel_cross_entropy(local_logits, labels, group).mean()
    loss.backward()
    torch.testing.assert_close(loss, dense_loss, **TOL)
    torch.testing.assert_close(emb.weight.grad, _shard(table.grad, 0, rank, world), **TOL)


def _check_init_is_layout_independent(rank: int, world: int, group) -> None:
    """The full model's weights for a seed are the same for t=1 and t=world."""
    cfg = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=8)
    full = GPTModel(cfg, 50, 64)
    init_parameters(full, 7, 0.02, 2)
    placements = Placements()
    part = apply_tensor_parallel(GPTModel(cfg, 50, 64), group, placements)
    init_parameters(part, 7, 0.02, 2, placements)
    full_params = dict(full.named_parameters())
    split = 0
    for name, p in part.named_parameters():
        expected = full_params[name]
        for s in placements[p].splits:
            assert (s.axis, s.size, s.index) == ("tp", world, rank), (name, s)
            expected = _shard(expected, s.dim, rank, world)
            split += 1
        torch.testing.assert_close(p, expected, rtol=0, atol=0, msg=name)
    assert split > 0  # the comparison covers split parameters


CHECKS = {  # name: (check, world size); all run in ONE spawn of 4 ranks, a world of 2 on ranks 0 and 1
    "linears-2": (_check_linears, 2),
    "linears-4": (_check_linears, 4),
    "fused-qkv-2": (_check_fused_qkv, 2),
    "embedding-and-loss-2": (_check_embedding_and_loss, 2),
    "embedding-and-loss-4": (_check_embedding_and_loss, 4),
    "init-2": (_check_init_is_layout_independent, 2),
}


def _run_checks(rank: int, world_size: int, out: str) -> None:
    """Every check on its group; a failed assertion is recorded (after its collectives, so that no peer
    hangs) and the next check runs."""
    groups = {2: dist.new_group([0, 1]), 4: dist.group.WORLD}
    failures = {}
    for name, (check, world) in CHECKS.items():
        if rank < world:
            try:
                check(rank, world, groups[world])
            except AssertionError:
                failures[name] = traceback.format_exc()
        dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps(failures))


@pytest.fixture(scope="module")
def failures(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("tp")
    pooled_spawn(_run_checks, 4, tmp, str(tmp))
    out: dict[str, str] = {}
    for rank in range(4):
        out.update(json.loads((tmp / f"rank{rank}.json").read_text()))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_column_then_row_parallel_matches_dense(failures, world):
    assert f"linears-{world}" not in failures, failures[f"linears-{world}"]


def test_fused_qkv_split_by_heads(failures):
    assert "fused-qkv-2" not in failures, failures["fused-qkv-2"]


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_embedding_and_cross_entropy(failures, world):
    assert f"embedding-and-loss-{world}" not in failures, failures[f"embedding-and-loss-{world}"]


def test_initialisation_independent_of_tensor_parallel_size(failures):
    assert "init-2" not in failures, failures["init-2"]
