"""The one door for collectives (``ptdp.observability.communication``): each call is recorded by the flight
recorder before it is issued, so a hang in it shows in the hang report. The callers below issued their
collectives around the recorder before they went through the door (vocabulary parallelism's stage and
heads, hybrid sharding's replica all-reduce, context parallelism's ring): a rank stuck there was invisible.
That every call of ptdp goes through the door is tests/codebase/test_architecture.py's check."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from helpers import pooled_spawn


def _recorded(rank: int, world: int) -> None:
    import torch.distributed as dist

    from ptdp.observability import communication, flight_recorder
    from ptdp.parallel.context.ring import ring_exchange, wait_all
    from ptdp.parallel.data.hybrid import Hybrid
    from ptdp.parallel.vocab.heads import tp_max, tp_sum
    from ptdp.parallel.vocab.stage import VocabStage
    from ptdp.schedule.actions import Action

    group, other = dist.group.WORLD, 1 - rank
    flight_recorder._OPS.clear()
    flight_recorder.enable()  # the watchdog's switch: records kept from here on
    try:
        # the context-parallel ring: one batched send/receive to the next rank, from the previous one
        recv, works = ring_exchange(torch.full((3,), float(rank)), group, rank, world)
        wait_all(works)
        assert recv.tolist() == [float(other)] * 3
        # the vocabulary heads' tensor-parallel sum and maximum
        assert tp_sum(torch.ones(2), group).tolist() == [2.0, 2.0]
        assert tp_max(torch.tensor([float(rank)]), group).tolist() == [1.0]
        # hybrid sharding: each reduced shard all-reduced over the replicas (the inner reducer stubbed)
        shard = torch.full((4,), float(rank + 1))
        inner = SimpleNamespace(buckets=[SimpleNamespace(shard=shard, param_shard=None)], frozen_buckets=[], params=[],
                                finish_grad_sync=lambda: None)
        Hybrid(inner, group).finish_grad_sync()
        assert shard.tolist() == [3.0] * 4
        # the vocabulary stage's pipeline collectives (the stage stubbed to the buffers they read)
        stage = SimpleNamespace(pp_group=group, pp_ranks=[0, 1], first_rank=0, last_rank=1, mtp_depth=0, p=world,
                                _works={}, _buf={("S", 0): torch.full((2,), float(rank)), ("C1", 0): torch.ones(2),
                                                 ("H", 0): torch.full((2,), float(rank)), ("EMB", 0): torch.ones(2)})
        for op in ("C0", "C1", "BCAST_H", "EMB"):
            VocabStage.collective(stage, Action(op, 0, 0))
        for work in stage._works.values():
            work.wait()
        assert [t.tolist() for t in stage._buf["C0", 0]] == [[0.0, 0.0], [1.0, 1.0]]
        assert stage._buf["H", 0].tolist() == [1.0, 1.0]  # the last stage's hidden states, broadcast
        # the door itself: an asynchronous call hands back its work
        work = communication.all_reduce(torch.ones(1), group=group, async_op=True, action="probe")
        assert work is not None
        work.wait()
    finally:
        flight_recorder.enable(False)
    ops = flight_recorder.last_operations()
    assert [(op["kind"], op["action"]) for op in ops] == [
        ("batch_isend_irecv", "cp_ring"),
        ("all_reduce", "vocab_sum"), ("all_reduce", "vocab_max"),
        ("all_reduce", "hybrid_grads"),
        ("all_gather", repr(Action("C0", 0, 0))), ("reduce", repr(Action("C1", 0, 0))),
        ("broadcast", repr(Action("BCAST_H", 0, 0))), ("reduce", repr(Action("EMB", 0, 0))),
        ("all_reduce", "probe"),
    ], ops
    ring = ops[0]
    assert ring["group"] == [0, 1] and ring["peer"] == [other, other] and ring["bytes"] == 2 * 3 * 4
    assert ops[5]["peer"] == 1 and ops[6]["peer"] == 1 and ops[7]["peer"] == 0  # reduce/broadcast name the root


def test_collectives_of_the_formerly_unrecorded_callers_reach_the_flight_recorder(tmp_path):
    pooled_spawn(_recorded, 2, tmp_path)


def test_a_call_through_the_door_is_recorded_before_it_is_issued(monkeypatch):
    """The record comes first (a hang inside the call is then the last operation recorded) and names the
    call's group, shape and purpose; torch's function is looked up at call time."""
    import torch.distributed as dist

    from ptdp.observability import communication, flight_recorder

    seen = []

    def fake_all_reduce(tensor, op=None, group=None, async_op=False):
        seen.append(flight_recorder.last_operations()[-1])
        return "work" if async_op else None

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    flight_recorder.enable()
    try:
        assert communication.all_reduce(torch.zeros(2, 3), async_op=True, action="probe") == "work"
    finally:
        flight_recorder.enable(False)
    assert seen and seen[0]["kind"] == "all_reduce" and seen[0]["action"] == "probe"
    assert seen[0]["shape"] == [2, 3] and seen[0]["bytes"] == 24
