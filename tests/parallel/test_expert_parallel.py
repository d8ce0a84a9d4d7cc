"""Expert parallelism at the layer level: the dispatchers, the slicing and the folding against one process.

A small MoE layer with the seam of ``ptdp.models.moe`` (router, stacked experts, dispatcher) runs in one
process and, split, on four gloo ranks in several foldings: every rank's output and input gradient, its
router gradient, and the expert gradients (reduced over the expert-data-parallel group) must equal the one
process values for each rank's tokens. Model-level equivalence (``ptdp train``) is test_moe_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import pooled_spawn, refused_in_process
from torch import nn

from ptdp.parallel.expert.apply import apply_expert_parallel
from ptdp.parallel.expert.dims import ExpertDims, ExpertParallel, expert_layout_errors
from ptdp.parallel.expert.dispatch import AllToAllDispatcher
from ptdp.parallel.placement import Placements, Split

E, H, F_, K, T = 4, 8, 12, 2, 6


class Experts(nn.Module):
    """Stacked GeLU experts ``[E, f, h]``, ``[E, h, f]`` run over tokens sorted by expert."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, F_, H) * 0.3)
        self.w2 = nn.Parameter(torch.randn(E, H, F_) * 0.3)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        outs = [F.linear(F.gelu(F.linear(chunk, w1)), w2)
                for chunk, w1, w2 in zip(x.split(tokens_per_expert.tolist()), self.w1, self.w2, strict=True)]
        return torch.cat(outs) if outs else x[:0]


class ToyMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts = E
        self.router = nn.Linear(H, E, bias=False)
        self.experts = Experts()
        self.dispatcher = AllToAllDispatcher(E, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        top, indices = logits.topk(K, dim=-1)
        probs = top.softmax(-1)
        rows, counts, ctx = self.dispatcher.dispatch(x, probs, indices)
        return self.dispatcher.combine(self.experts(rows, counts), ctx)


def _reference():
    """The one-process layer's outputs and, per replica of tokens, the input and parameter gradients."""
    torch.manual_seed(0)
    layer = ToyMoE()
    xs = torch.randn(4, T, H, requires_grad=True)  # up to four replicas' tokens
    weights = torch.randn(4, T, H)
    outs, grads = [], []
    for x, w in zip(xs, weights, strict=True):
        layer.zero_grad()
        out = layer(x)
        (out * w).sum().backward()
        outs.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in layer.named_parameters()})
    return layer, xs, weights, outs, grads


# (name, world, t, e, dispatcher): t > 1 puts ranks 2i, 2i+1 on the same tokens (attention's TP group)
CASES = [("e2d2", 1, 2, "alltoall"), ("e2d2-ag", 1, 2, "allgather"), ("e4", 1, 4, "alltoall"),
         ("e4-ag", 1, 4, "allgather"), ("t2e2", 2, 2, "alltoall"), ("t2e2-ag", 2, 2, "allgather"),
         ("t2e4", 2, 4, "alltoall"), ("t2e1", 2, 1, "allgather")]


def _worker(rank: int, world: int) -> None:
    import torch.distributed as dist

    ref, xs, weights, ref_out, ref_grads = _reference()
    tp_groups = {t: [dist.new_group([r, r + 1]) for r in range(0, world, 2)] if t > 1 else None for t in (1, 2)}
    for name, t, e, kind in CASES:
        torch.manual_seed(0)
        layer = ToyMoE()
        token_group = tp_groups[t][rank // 2] if t > 1 else None
        expert = ExpertParallel(ExpertDims(world, 1, e, 1), rank, torch.device("cpu"), token_group)
        placements = Placements()
        apply_expert_parallel(layer, expert, placements, kind)
        replica = rank // t
        x = xs[replica].detach().clone().requires_grad_(True)
        out = layer(x)
        (out * weights[replica]).sum().backward()
        torch.testing.assert_close(out, ref_out[replica], rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(x.grad, xs.grad[replica], rtol=1e-5, atol=1e-6, msg=name)
        # The router is replicated: its gradient is this replica's part; summed over one rank per replica
        # it is the one-process gradient.
        router = layer.router.weight.grad.clone() if rank % t == 0 else torch.zeros_like(layer.router.weight)
        dist.all_reduce(router)
        replicas = range(world // t)
        expected = {n: sum(ref_grads[r][n] for r in replicas) for n in ref_grads[0]}
        torch.testing.assert_close(router, expected["router.weight"], rtol=1e-5, atol=1e-6, msg=name)
        local = E // e
        for (pname, param), full in zip(layer.experts.named_parameters(), ref.experts.parameters(), strict=True):
            full_grad = expected[f"experts.{pname}"]
            placement = placements[param]
            assert placement.role == "expert" and param.shape[0] == local, (name, pname)
            assert placement.splits == (Split("ep", 0, e, expert.ep_rank),), (name, pname)
            grad = param.grad.clone()
            dist.all_reduce(grad, group=expert.edp_group)
            mine = slice(expert.ep_rank * local, (expert.ep_rank + 1) * local)
            torch.testing.assert_close(param.detach(), full.detach()[mine], msg=name)
            torch.testing.assert_close(grad, full_grad[mine], rtol=1e-5, atol=1e-6, msg=f"{name} {pname}")


def test_dispatchers_match_one_process(tmp_path):
    pooled_spawn(_worker, 4, tmp_path)


def test_folded_groups_follow_megatron_core_order():
    """etp-ep-edp-pp: with etp = 1 the expert-parallel groups are runs of e adjacent ranks, so at t = e
    they are attention's tensor-parallel groups; the pipeline stage is attention's."""
    dims = ExpertDims(world_size=8, pp=2, ep=2, etp=1)
    assert dims.edp == 2
    assert dims.groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.groups("edp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.coordinates(5) == (1, 0, 1, 0)
    wide = ExpertDims(world_size=8, pp=1, ep=4, etp=2)
    assert wide.groups("etp")[:2] == [[0, 1], [2, 3]]
    assert wide.groups("ep")[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert wide.groups("edp") == [[r] for r in range(8)]


@pytest.mark.parametrize(("kwargs", "expected"), [
    (dict(e=3, num_experts=4), "does not divide --num-experts 4"),
    (dict(e=4, world_size=2), "world size 2 is not divisible by --expert-tensor-parallel-size"),
    (dict(e=2, t=4, etp=2, world_size=8), "only 1 or t = 4 fold"),
    (dict(e=2, num_experts=None), "needs a mixture-of-experts model"),
    (dict(e=2, t=2, tokens_per_rank=7), "7 tokens are not divisible"),
])
def test_bad_expert_layouts(kwargs, expected):
    args = dict(world_size=4, t=1, c=1, p=1, e=2, etp=1, num_experts=4, sequence_parallel=False,
                tokens_per_rank=8)
    args.update(kwargs)
    errors = expert_layout_errors(**args)
    assert any(expected in line for line in errors), errors
    assert all("\n" not in line for line in errors)


def test_good_layouts_have_no_errors():
    for e, t, etp in ((1, 1, 1), (2, 1, 1), (4, 1, 1), (2, 2, 1), (4, 2, 1), (2, 2, None), (1, 2, 2)):
        for sp in (False, True):  # etp = t with --sequence-parallel: the dispatcher gathers over the TP group
            assert expert_layout_errors(world_size=4, t=t, c=1, p=1, e=e, etp=etp, num_experts=4,
                                        sequence_parallel=sp, tokens_per_rank=8) == [], (e, t, etp, sp)


def test_bad_expert_flags_exit_2_with_every_problem_one_line_each(capsys):
    proc = refused_in_process(["train", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads",
                               "2", "--seq-length", "8", "--micro-batch-size", "1", "--global-batch-size",
                               "1", "--train-iters", "1", "--num-experts", "3", "--moe-router-topk", "1",
                               "--expert-model-parallel-size", "2"], capsys)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2, lines
    assert "--expert-model-parallel-size 2 does not divide --num-experts 3" in lines[0]
    assert "world size 1 is not divisible by --expert-tensor-parallel-size" in lines[1]
