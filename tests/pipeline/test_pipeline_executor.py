"""run_schedule on real gloo processes equals the single-process model: losses and every gradient.

One spawn per pipeline size runs every (schedule, v, m) config in sequence and saves its results; the
parametrised tests compare them with the dense reference. p == 1 runs in-process (no communication).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import pooled_spawn
from torch import nn

from ptdp.parallel.pipeline.executor import run_schedule
from ptdp.parallel.pipeline.handlers import Handler
from ptdp.parallel.pipeline.module_stage import ModuleStage, PlainBatches, StageLayout
from ptdp.parallel.pipeline.p2p import P2PComm
from ptdp.schedule.actions import Action, peak_in_flight
from ptdp.schedule.registry import build_schedule

HIDDEN, MICRO_BATCH = 8, 2

# (name, schedule, v, m, hooks)
CONFIGS = {
    2: [
        ("gpipe-m3", "gpipe", 1, 3, False),
        ("gpipe-m1", "gpipe", 1, 1, False),
        ("1f1b-m5", "1f1b", 1, 5, False),
        ("interleaved-v2-m4", "interleaved", 2, 4, False),
        ("interleaved-v2-m2", "interleaved", 2, 2, False),
        ("interleaved-v3-m6", "interleaved", 3, 6, False),
        ("zb-h1-m4", "zb-h1", 1, 4, False),
        ("interleaved-hooks", "interleaved", 2, 4, True),
    ],
    4: [
        ("gpipe-m6", "gpipe", 1, 6, False),
        ("gpipe-m8", "gpipe", 1, 8, False),
        ("1f1b-m8", "1f1b", 1, 8, False),
        ("1f1b-m2", "1f1b", 1, 2, False),
        ("interleaved-v2-m8", "interleaved", 2, 8, False),
        ("interleaved-v2-m4", "interleaved", 2, 4, False),
        ("zb-h1-m6", "zb-h1", 1, 6, False),
        ("1f1b-hooks", "1f1b", 1, 5, True),
    ],
}


def make_model(n_stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(n_stages)])


def make_data(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(m, MICRO_BATCH, HIDDEN, generator=g), torch.randn(m, MICRO_BATCH, HIDDEN, generator=g)


class Batches(PlainBatches):
    """The ``BatchSource`` of ``inputs[mb]`` and ``targets[mb]``."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.x, self.y, self.num_microbatches = inputs, targets, len(inputs)

    def inputs(self, microbatch: int) -> torch.Tensor:
        return self.x[microbatch]

    def labels(self, microbatch: int) -> torch.Tensor:
        return self.y[microbatch]


def loss_fn(y: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    return ((y - target) ** 2).mean()  # the stage divides by m (plain windows: no weights)


def make_stage(chunks, rank: int, p: int, v: int, m: int, forward_only: bool = False) -> ModuleStage:
    return ModuleStage(chunks, StageLayout(rank, p, v), Batches(*make_data(m)), loss_fn, forward_only=forward_only)


def reference(n_stages: int, m: int) -> tuple[list[float], list[list[torch.Tensor]]]:
    """Dense single-process forward/backward over all microbatches: the ground truth."""
    model = make_model(n_stages)
    inputs, targets = make_data(m)
    losses = []
    for mb in range(m):
        loss = loss_fn(model(inputs[mb]), targets[mb]) / m
        loss.backward()
        losses.append(loss.item())
    return losses, [[q.grad.clone() for q in block.parameters()] for block in model]


def run_rank(rank: int, p: int, schedule: str, v: int, m: int, comm: P2PComm | None):
    """Build this rank's chunks of the reference model and run its schedule; return (stats, grads)."""
    model = make_model(p * v)
    chunks = [model[c * p + rank] for c in range(v)]
    stage = make_stage(chunks, rank, p, v, m)
    actions = build_schedule(schedule, p, v, m, rank)
    stats = run_schedule(actions, stage, comm)
    grads = {c * p + rank: [q.grad.clone() for q in chunks[c].parameters()] for c in range(v)}
    return actions, stats, grads


def _worker(rank: int, p: int, out_dir: str) -> None:
    """Every case of ``CONFIGS[p]`` on this rank, in a rank of the session's pool (``helpers.pooled_spawn``:
    the gloo group is up, one thread)."""
    # one communicator per direction (what training uses) for the cases without hooks; one for the rest
    directions = {kind: dist.new_group(list(range(p))) for kind in ("F", "B")}
    for name, schedule, v, m, hooks in CONFIGS[p]:
        calls = {"pack": 0, "unpack": 0}

        def pack(t, calls=calls):
            calls["pack"] += 1
            return torch.stack([2 * t, -t])  # a different shape and both halves needed to undo it

        def unpack(u, calls=calls):
            calls["unpack"] += 1
            return (u[0] / 2 - u[1]) / 2

        comm = P2PComm(list(range(p)), (MICRO_BATCH, HIDDEN), pack=pack if hooks else None,
                       unpack=unpack if hooks else None,
                       packed_shape=(2, MICRO_BATCH, HIDDEN) if hooks else None,
                       groups=None if hooks else directions, ahead=0 if hooks else None)
        actions, stats, grads = run_rank(rank, p, schedule, v, m, comm)
        n_send = sum(a.op.startswith("SEND") for a in actions)
        n_recv = sum(a.op.startswith("RECV") for a in actions)
        torch.save({"stats": stats, "grads": grads, "expected_peak": peak_in_flight(actions),
                    "calls": calls, "n_send": n_send, "n_recv": n_recv, "ahead": comm.received_ahead},
                   Path(out_dir) / f"{name}.rank{rank}.pt")
        dist.barrier()


def _spawn(p: int, tmp: Path) -> Path:
    pooled_spawn(_worker, p, tmp, str(tmp), timeout=120)
    return tmp


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, Path]:
    return {p: _spawn(p, tmp_path_factory.mktemp(f"pp{p}")) for p in CONFIGS}


CASES = [(p, *cfg) for p, cfgs in CONFIGS.items() for cfg in cfgs]


@pytest.mark.parametrize("p,name,schedule,v,m,hooks", CASES, ids=[f"p{c[0]}-{c[1]}" for c in CASES])
def test_matches_single_process(results, p, name, schedule, v, m, hooks):
    ref_losses, ref_grads = reference(p * v, m)
    got_grads, ahead = {}, 0
    for rank in range(p):
        res = torch.load(results[p] / f"{name}.rank{rank}.pt", weights_only=False)
        got_grads.update(res["grads"])
        stats = res["stats"]
        assert stats.peak_in_flight == res["expected_peak"]
        assert stats.peak_saved_bytes > 0
        assert stats.busy_s > 0 and stats.wall_s >= stats.busy_s
        if hooks:  # applied on both sides, once per message
            assert res["calls"] == {"pack": res["n_send"], "unpack": res["n_recv"]}
            assert res["ahead"] == 0  # ahead=0: every receive posted in its batch (NCCL's way)
        else:  # gloo: receives posted before their batch (P2PComm.expect), the same gradients
            assert 0 <= res["ahead"] <= res["n_recv"]
            ahead += res["ahead"]
        if rank == (p * v - 1) % p:
            assert sorted(stats.losses) == list(range(m))
            torch.testing.assert_close([float(x) for x in stats.losses.values()], ref_losses, rtol=1e-6, atol=0)
        else:
            assert stats.losses == {}
    assert hooks or m == 1 or ahead > 0
    assert sorted(got_grads) == list(range(p * v))
    for s in range(p * v):
        torch.testing.assert_close(got_grads[s], ref_grads[s], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("schedule,v,m", [("gpipe", 1, 3), ("1f1b", 1, 2), ("interleaved", 3, 2),
                                          ("interleaved", 2, 1), ("zb-h1", 1, 3)])
def test_single_rank_hands_tensors_over_locally(schedule, v, m):
    ref_losses, ref_grads = reference(v, m)
    _, stats, grads = run_rank(0, 1, schedule, v, m, comm=None)
    torch.testing.assert_close([float(x) for x in stats.losses.values()], ref_losses, rtol=1e-6, atol=0)
    for s in range(v):
        torch.testing.assert_close(grads[s], ref_grads[s], rtol=1e-6, atol=1e-9)


def test_saved_bytes_follow_in_flight_microbatches():
    """Rank 0 of p=4, m=8: GPipe stashes 8 microbatches, 1F1B 4, so twice the saved activation bytes."""
    m, p = 8, 4

    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        model = make_model(p)
        stage = make_stage([model[0]], 0, p, 1, m)
        compute = [a for a in build_schedule(schedule, p, 1, m, 0) if a.op in ("F", "B")]
        grads = iter(  # rank 0 alone: feed fake output gradients instead of receiving them
            [torch.ones(MICRO_BATCH, HIDDEN)] * m)
        orig_backward = stage.backward
        stage.backward = lambda c, mb, g, _b=orig_backward, _g=grads: _b(c, mb, next(_g))
        stats = run_schedule(compute, stage, comm=None)
        peaks[schedule] = (stats.peak_in_flight, stats.peak_saved_bytes)
    assert peaks["gpipe"][0] == 8 and peaks["1f1b"][0] == 4
    assert peaks["gpipe"][1] == 2 * peaks["1f1b"][1]


def test_comm_actions_without_comm_is_an_error():
    with pytest.raises(ValueError, match="no comm"):
        run_rank(0, 2, "1f1b", 1, 2, comm=None)


def test_a_new_action_kind_runs_through_its_registered_handler():
    """How a new schedule plugs in (DualPipeV's overlapped pair, say): its lists carry an op the executor
    does not know, and a handler registered for it runs it with the schedule's context. Here "FX" is a
    forward run by a handler (receive, stage.forward, deliver), "BX" a backward through the context's own
    compute (a composite action's building block), "NOTE" a marker with a timed span; the result equals the
    reference, and the spans say where the handlers ran."""
    v, m = 2, 3
    ref_losses, ref_grads = reference(v, m)
    model = make_model(v)
    chunks = [model[0], model[1]]
    stage = make_stage(chunks, 0, 1, v, m)
    ran: list[Action] = []

    def forward(a: Action, schedule) -> None:
        x = schedule.receive("F", a.microbatch, a.chunk)
        schedule.deliver("F", a.microbatch, a.chunk, schedule.stage.forward(a.chunk, a.microbatch, x))
        ran.append(a)

    actions = []
    for a in build_schedule("interleaved", 1, v, m, 0):
        renamed = {"F": [Action("FX", a.microbatch, a.chunk), Action("NOTE", a.microbatch, a.chunk)],
                   "B": [Action("BX", a.microbatch, a.chunk)]}
        actions += renamed.get(a.op, [a])
    spans = []
    handlers = {"FX": Handler(forward), "NOTE": Handler(lambda a, _: None, "note", "p2p"),
                "BX": Handler(lambda a, schedule: schedule.compute(Action("B", a.microbatch, a.chunk)))}
    stats = run_schedule(actions, stage, handlers=handlers,
                         recorder=lambda name, category, *_: spans.append((name, category)))
    assert len(ran) == v * m and spans.count(("note", "p2p")) == v * m
    assert spans.count(("backward", "compute")) == v * m
    torch.testing.assert_close([float(x) for x in stats.losses.values()], ref_losses, rtol=1e-6, atol=0)
    for s in range(v):
        torch.testing.assert_close([q.grad for q in chunks[s].parameters()], ref_grads[s], rtol=1e-6, atol=1e-9)


def test_an_op_without_a_handler_stops_the_run_before_it_starts():
    stage = make_stage([make_model(1)[0]], 0, 1, 1, 2)
    actions = [Action("F", 0, 0), Action("DUALPIPE_FB", 0, 0), Action("B", 0, 0)]
    with pytest.raises(ValueError, match=r"no handler registered for the action op\(s\) \['DUALPIPE_FB'\]"):
        run_schedule(actions, stage)
    assert stage.losses == {}  # nothing ran
    with pytest.raises(ValueError, match="two handlers registered"):
        stage.handlers = lambda: {"X": Handler(lambda a, _: None)}
        run_schedule([Action("X", 0, 0)], stage, handlers={"X": Handler(lambda a, _: None)})


def test_forward_only_mode_keeps_nothing_and_gives_the_losses():
    """Evaluation's stage is the training one in forward-only mode: same losses, no graph, no stash."""
    m = 3
    ref_losses, _ = reference(2, m)
    model = make_model(2)
    stage = make_stage([model[0], model[1]], 0, 1, 2, m, forward_only=True)
    actions = build_schedule("interleaved", 1, 2, m, 0, forward_only=True)
    stats = run_schedule(actions, stage)
    torch.testing.assert_close([float(x) for x in stats.losses.values()], ref_losses, rtol=1e-6, atol=0)
    assert not stage._stash and all(not x.requires_grad for x in stats.losses.values())
