"""Muon's parts: the Newton–Schulz iteration (``low`` is torch.optim.Muon's to the bit), the units read from
the placements (QKV per head group, gate/up, each expert), owners balanced by FLOPs, the distributed exchange
on real processes (each matrix orthogonalised once, whole; every rank gets exactly its range back; the
collectives it issues are the NCCL model's), and the NCCL model of the optimizer step."""

from __future__ import annotations

import pytest
import torch
from helpers import pooled_spawn
from torch import nn

from ptdp.optim.muon_exchange import Exchange, Grid, Shards, assign_owners
from ptdp.optim.muon_units import QKVLayout, is_hidden_matrix, units_of
from ptdp.optim.newton_schulz import COEFFICIENTS, coefficient_schedule, newton_schulz, scale_factor
from ptdp.parallel.placement import Placement, Split
from ptdp.simulate.nccl.model import check_all_send_models, check_trace
from ptdp.simulate.nccl.optimizer import StepLayout, groups_of, record_step_trace, step_collectives


@pytest.mark.parametrize("shape", [(8, 5), (5, 8), (16, 16), (64, 12)])
def test_low_precision_is_torch_muons_iteration_to_the_bit(shape):
    from torch.optim._muon import _zeropower_via_newtonschulz

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    want = _zeropower_via_newtonschulz(x, COEFFICIENTS["simple"][0], 5, 1e-7).float()
    assert torch.equal(newton_schulz(x, coefficient_schedule("simple", 5), "low"), want)


@pytest.mark.parametrize("precision", ["low", "medium", "high"])
@pytest.mark.parametrize("kind,steps", [("quintic", 5), ("simple", 5), ("polar_express", 8), ("aol", 4)])
def test_newton_schulz_orthogonalises(kind, steps, precision):
    """Singular values pushed into the band the coefficient sets aim at (about [0.5, 1.5]), the singular
    vectors kept: O ≈ U Vᵀ of the input, in either orientation."""
    for shape in ((24, 10), (10, 24)):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        out = newton_schulz(x, coefficient_schedule(kind, steps), precision)
        s = torch.linalg.svdvals(out)
        assert out.shape == x.shape and out.dtype == torch.float32
        assert 0.3 < s.min() and s.max() < 1.6, (kind, s)
        u, _, vt = torch.linalg.svd(x, full_matrices=False)
        assert torch.nn.functional.cosine_similarity((u @ vt).flatten(), out.flatten(), dim=0) > 0.9


def test_schedules_and_scales():
    assert coefficient_schedule("quintic", 10) == list(COEFFICIENTS["quintic"]) * 2
    assert coefficient_schedule("polar_express", 10)[-3:] == [COEFFICIENTS["polar_express"][-1]] * 3
    assert scale_factor(256, 64, "spectral") == 16.0 and scale_factor(256, 64, "spectral", 0.2) == pytest.approx(3.2)
    assert scale_factor(256, 64, "shape_scaling") == 2.0 and scale_factor(64, 256, "shape_scaling") == 1.0
    assert scale_factor(64, 256, "unit_rms_norm") == 0.5


def test_the_split_follows_the_placements():
    """Hidden matrices by role, decay and name; QKV per projection (GQA: per kind across the head groups),
    gate/up and each expert apart; the tensor-parallel split is carried into the unit."""
    w = nn.Parameter(torch.zeros(4, 4))
    assert is_hidden_matrix(Placement("layers.0.mlp.fc1.weight"), w)
    assert not is_hidden_matrix(Placement("layers.0.mlp.fc1.bias", weight_decay=False), w)
    assert not is_hidden_matrix(Placement("embedding.word_embeddings.weight"), w)
    assert not is_hidden_matrix(Placement("lm_head.weight"), w)
    assert not is_hidden_matrix(Placement("embedding.word_embeddings.weight", role="embedding_copy"), w)
    assert not is_hidden_matrix(Placement("x", role="vocab"), w)
    kw = {"scale_mode": "spectral", "extra_scale": 1.0}
    # GQA, a = 4 heads of d = 2 in G = 2 groups, t = 2: this rank holds group 1's rows
    qkv = nn.Parameter(torch.zeros(8, 6))
    gqa = Placement("layers.0.attention.qkv.weight", splits=(Split("tp", 0, 2, 1),))
    (unit,) = units_of(qkv, gqa, qkv=QKVLayout(2, 2), split_qkv=True, **kw)
    assert unit.full_shape == (16, 6) and unit.split_dim == 0
    assert [m.ranges for m in unit.matrices] == [((0, 4), (8, 12)), ((4, 6), (12, 14)), ((6, 8), (14, 16))]
    assert [m.shape for m in unit.matrices] == [(8, 6), (4, 6), (4, 6)]
    (whole,) = units_of(qkv, gqa, qkv=QKVLayout(2, 2), split_qkv=False, **kw)
    assert [m.shape for m in whole.matrices] == [(16, 6)]
    # [3, a·d, h] with t = 2 on dim 1: q, k, v apart (or one [3·a·d, h] matrix)
    fused = nn.Parameter(torch.zeros(3, 4, 6))
    mha = Placement("layers.1.attention.qkv.weight", splits=(Split("tp", 1, 2, 0),))
    units = units_of(fused, mha, qkv=None, split_qkv=True, **kw)
    assert [(u.start, u.end, u.full_shape, u.split_dim) for u in units] == [(0, 24, (8, 6), 0), (24, 48, (8, 6), 0),
                                                                           (48, 72, (8, 6), 0)]
    (one,) = units_of(fused, mha, qkv=None, split_qkv=False, **kw)
    assert one.full_shape == (3, 8, 6) and one.split_dim == 1 and one.matrices[0].shape == (24, 6)
    # two local experts of [E, 2, f, h] split over etp on f: four [f, h] matrices
    experts = nn.Parameter(torch.zeros(2, 2, 3, 4))
    placement = Placement("layers.0.mlp.experts.fc1_weight", (Split("ep", 0, 2, 1), Split("etp", 2, 2, 0)), "expert")
    units = units_of(experts, placement, qkv=None, split_qkv=True, **kw)
    assert len(units) == 4 and all(u.full_shape == (6, 4) and u.role == "expert" for u in units)
    with pytest.raises(ValueError, match="cuts across matrices"):
        units_of(fused, Placement("x.weight", splits=(Split("tp", 0, 3, 0),)), qkv=None, split_qkv=True, **kw)


def test_owners_balance_flops_not_counts():
    """One big matrix and many small ones over 4 slots: the big one's slot gets nothing else."""
    from ptdp.optim.muon_units import Matrix, Unit

    def unit(name, n):
        return Unit(name, None, "dense", 0, n * n, (n, n), None, 1, (Matrix(None, (n, n), 1.0),))

    units = [unit("big", 64)] + [unit(f"s{i}", 16) for i in range(12)]
    owners = assign_owners(units, 4, 5)
    assert owners.count(owners[0]) == 1
    loads = [sum(u.flops(5) for u, o in zip(units, owners, strict=True) if o == s) for s in range(4)]
    assert max(loads[s] for s in range(4) if s != owners[0]) < 2 * min(loads[s] for s in range(4) if s != owners[0])


# -- the exchange on 4 real processes: T = 2 tensor-parallel ranks x D = 2 data-parallel ranks -------------

# (name, full shape, split dim or None): split over TP on dim 0, on dim 1, and replicated
MATRICES = [("a.weight", (8, 6), 0), ("b.weight", (6, 10), 1), ("c.weight", (4, 4), None), ("d.weight", (12, 6), 0)]


def _exchange_worker(rank: int, world: int, sharded: bool) -> None:
    import torch.distributed as dist

    from ptdp.observability import flight_recorder

    t, d = 2, 2
    dp_rank, tp_rank = divmod(rank, t)
    tp_groups = [dist.new_group([dp * t + i for i in range(t)]) for dp in range(d)]
    dp_groups = [dist.new_group([j * t + tp for j in range(d)]) for tp in range(t)]
    tp_group, dp_group = tp_groups[dp_rank], dp_groups[tp_rank]
    g = torch.Generator().manual_seed(0)
    fulls = {name: torch.randn(*shape, generator=g) for name, shape, _ in MATRICES}
    params, units = {}, []
    for name, _, dim in MATRICES:
        local = fulls[name] if dim is None else fulls[name].chunk(t, dim)[tp_rank]
        params[name] = nn.Parameter(local.clone())
        splits = () if dim is None else (Split("tp", dim, t, tp_rank),)
        units += units_of(params[name], Placement(name, splits), qkv=None, split_qkv=True, scale_mode="spectral",
                          extra_scale=1.0)
    total = sum(p.numel() for p in params.values())
    size = -(-total // d) if sharded else total
    shards, offset = {}, 0
    for name in params:  # one bucket, cut into d shards that straddle the parameters
        shards[params[name]] = Shards(offset, size, d if sharded else 1)
        offset += params[name].numel()
    calls = []

    def expected(full):  # any function of the whole matrix, sensitive to where each element is
        return full * 2 + torch.arange(full.numel(), dtype=full.dtype).view(full.shape)

    def transform(full, unit):
        calls.append(unit.name)
        return expected(full)

    grid = Grid(units, shards, tp_group, dp_group, 5)
    inputs = {}
    for p in params.values():
        lo, hi = shards[p].held(dp_rank, p.numel())
        if hi > lo:
            inputs[p] = (lo, p.detach().reshape(-1)[lo:hi].clone())
    flight_recorder._OPS.clear()
    flight_recorder.enable()  # the watchdog's switch: records kept from here on
    try:
        out = Exchange([grid], transform, torch.device("cpu")).orthogonalize(inputs)
    finally:
        flight_recorder.enable(False)
    for name, _, dim in MATRICES:
        p = params[name]
        want = expected(fulls[name])
        want = (want if dim is None else want.chunk(t, dim)[tp_rank]).reshape(-1)
        if p in inputs:
            lo, x = inputs[p]
            torch.testing.assert_close(out[p], want[lo:lo + x.numel()], rtol=0, atol=0)
    everyone = [None] * world
    dist.all_gather_object(everyone, calls)
    assert sorted(c for rank_calls in everyone for c in rank_calls) == sorted(n for n, _, _ in MATRICES)
    issued = [(op["action"], op["group"]) for op in flight_recorder.last_operations()
              if (op["action"] or "").startswith("muon")]
    lay = StepLayout(world, tp=t, strategy="optim" if sharded else "no_shard")
    groups = groups_of(rank, lay)
    assert issued == [(what, groups[comm]) for comm, what in step_collectives(rank, lay) if what.startswith("muon")]


@pytest.mark.parametrize("sharded", [True, False], ids=["zero", "no-shard"])
def test_exchange_orthogonalises_each_matrix_once_and_returns_each_rank_its_range(tmp_path, sharded):
    pooled_spawn(_exchange_worker, 4, tmp_path, sharded)


# -- the NCCL model of the step ---------------------------------------------------------------------------

STEP_LAYOUTS = {
    "t2p2d2-no-shard": (StepLayout(8, tp=2, pp=2), "interleaved", 2),
    "t2p2d2-zero1": (StepLayout(8, tp=2, pp=2, strategy="optim"), "1f1b", 1),
    "p2d2-zero3-zbv": (StepLayout(4, pp=2, strategy="optim_grads_params"), "zbv", 2),
    "t2c2d2-hybrid": (StepLayout(8, tp=2, cp=2, strategy="optim_grads", instances=2), "1f1b", 1),
    "t2d2e4-folded-zero1": (StepLayout(4, tp=2, strategy="optim", ep=4, etp=1), "1f1b", 1),
    "p2t2d2e2-zero3": (StepLayout(8, tp=2, pp=2, strategy="optim_grads_params", ep=2, etp=2), "1f1b", 1),
}


@pytest.mark.parametrize("name", STEP_LAYOUTS)
def test_the_optimizer_step_after_the_schedule_is_deadlock_free_under_nccl(name):
    lay, schedule, v = STEP_LAYOUTS[name]
    trace = record_step_trace(lay, schedule, v, 4)
    assert any(e["issue"][0]["msg"] == ["muon_tp_gather"] for rank in trace["ranks"] for e in rank
               if "issue" in e and e["issue"][0]["op"] == "coll") == (lay.tp > 1)
    for model, problems in check_all_send_models(trace).items():
        assert not problems, (model, problems[:3])


def test_a_rank_skipping_an_empty_exchange_is_caught():
    """Why every exchange is issued, empty or not: a rank with nothing to send that skipped it would leave
    its peers waiting."""
    trace = record_step_trace(StepLayout(8, tp=2, pp=2, strategy="optim"), "1f1b", 1, 4)
    events = trace["ranks"][0]
    k = next(i for i, e in enumerate(events) if "issue" in e and e["issue"][0].get("msg") == ["muon_dp_gather"])
    number = sum("issue" in e for e in events[:k])
    del events[k:k + 2]  # the issue and its wait
    for e in events[k:]:  # later issues move up one
        if "wait" in e and e["wait"] > number:
            e["wait"] -= 1
    problems = check_trace(trace, False)
    assert any("unmatched" in p or "deadlock" in p for p in problems), problems
