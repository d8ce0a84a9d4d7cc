"""The optimizer step's collectives under the NCCL model, after a pipeline schedule, on every rank of a layout.

After the schedule and ``finish_grad_sync`` (every gradient reduction waited for), the step issues, on
every rank and in this order (``ptdp.optim.optimizer.MegatronOptimizer.step``):

1. the gradient norm's all-reduce over its groups (the world when data-parallel ranks hold shards or with
   experts; tensor- and pipeline-parallel groups, plus one hybrid instance, otherwise);
2. with ``--optimizer muon``, per grid (dense, then experts; ``ptdp.optim.muon_exchange.ROLES``) the four
   exchanges of ``ptdp.optim.muon_exchange.COLLECTIVES``: data-parallel gather, tensor-parallel gather and
   scatter, data-parallel scatter -- on the same groups the gradients were reduced over (dp-cp or one
   hybrid instance, and the expert-data-parallel group) and the tensor-parallel group (experts: expert-tensor);
3. under ZeRO-1/2 the parameters' all-gather over each data-parallel group (ZeRO-3 gathers in the schedule).

:func:`record_step_trace` builds the whole world's trace: each rank's pipeline events (``record_comm_trace``
on the schedule's lists, p2p peers mapped to global ranks) followed by these collectives, each on the
communicator of its process group, each waited for at once (the host blocks on them). ``check_trace`` plays
it. Every member of a group issues the group's collectives in the same order because the sequence is a
function of the layout alone -- each exchange is issued whether or not this rank has anything to send
(tests/optim/test_muon.py checks the real ``Exchange`` issues exactly :func:`step_collectives`' sequence).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from ptdp.optim.muon_exchange import COLLECTIVES, ROLES
from ptdp.parallel.dims import ParallelDims
from ptdp.parallel.expert.dims import ExpertDims
from ptdp.simulate.nccl.model import record_comm_trace


@dataclass(frozen=True)
class StepLayout:
    """The layout the step runs in: world = t·c·d·p ranks, ``instances`` hybrid-sharding instances, the
    ZeRO ``strategy``, experts (``ep`` > 0: e and etp over the same ranks), and whether Muon runs."""

    world: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    strategy: str = "no_shard"
    instances: int = 1
    ep: int = 0
    etp: int = 1
    muon: bool = True


def _instance(ranks: list[int], rank: int, k: int) -> list[int]:
    """The hybrid instance (``ptdp.parallel.data.hybrid``: k runs of consecutive ranks) holding ``rank``."""
    size = len(ranks) // k
    i = ranks.index(rank) // size
    return ranks[i * size:(i + 1) * size]


def groups_of(rank: int, lay: StepLayout) -> dict[str, list[int]]:
    """The process groups ``rank`` takes part in, by communicator name (each group is one communicator)."""
    dims = ParallelDims(lay.world, lay.tp, lay.pp, lay.cp)
    pp, dp, tp = dims.coordinates(rank)
    cp = dims.cp_rank_of(rank)
    dp_cp = sorted(dims.rank_of(pp, d, tp, c) for d in range(dims.dp) for c in range(dims.cp))
    sharded = lay.strategy != "no_shard"
    out = {"tp": [dims.rank_of(pp, dp, t, cp) for t in range(dims.tp)],
           "pp-norm": [dims.rank_of(q, dp, tp, cp) for q in range(dims.pp)],
           "dp": _instance(dp_cp, rank, lay.instances) if sharded and lay.instances > 1 else dp_cp,
           "world": list(range(lay.world))}
    if lay.ep:
        experts = ExpertDims(lay.world, lay.pp, lay.ep, lay.etp)
        edp = next(g for g in experts.groups("edp") if rank in g)
        out["etp"] = next(g for g in experts.groups("etp") if rank in g)
        out["edp"] = _instance(edp, rank, lay.instances) if sharded and lay.instances > 1 else edp
    return out


def step_collectives(rank: int, lay: StepLayout) -> list[tuple[str, str]]:
    """(communicator, what) of each collective ``rank`` issues in the step, in order (module docstring)."""
    groups = groups_of(rank, lay)
    sharded = lay.strategy != "no_shard"
    if lay.ep or (sharded and lay.instances == 1 and lay.world // (lay.tp * lay.pp) > 1):
        norm = ["world"]
    else:
        norm = ["tp", "pp-norm"] + (["dp"] if sharded and lay.instances > 1 else [])
    out = [(comm, "grad_norm") for comm in norm]
    grids = {"dense": ("tp", "dp"), "expert": ("etp", "edp")}
    for role in ROLES if lay.muon else ():
        if role == "expert" and not lay.ep:
            continue
        tp, dp = grids[role]
        out += [(tp if kind == "tp" else dp, action) for kind, action in COLLECTIVES]
    if sharded and lay.strategy != "optim_grads_params":
        out += [(comm, "zero_params") for comm in ("dp", "edp") if comm in groups]
    return [(comm, what) for comm, what in out if len(groups[comm]) > 1]


def record_step_trace(lay: StepLayout, schedule: str = "1f1b", v: int = 1, m: int = 4) -> dict:
    """The world's trace: every rank's pipeline events (``schedule`` over p = ``lay.pp`` stages, ``m``
    microbatches) then its step's collectives (module docstring). ``check_trace`` plays it. The trace lists
    the ranks pipeline by pipeline (index k·p + pipeline rank, as ``nccl_model`` expects); the groups are
    the real ones, renumbered alike."""
    dims = ParallelDims(lay.world, lay.tp, lay.pp, lay.cp)
    pipeline = record_comm_trace(schedule, lay.pp, v, m, per_direction=True) if lay.pp > 1 else None
    order = sorted(range(lay.world), key=lambda g: (g % (lay.world // lay.pp), dims.coordinates(g)[0]))
    index = {g: i for i, g in enumerate(order)}  # global rank -> its place in the trace
    ranks = []
    for rank in order:
        pp, dp, tp = dims.coordinates(rank)
        cp = dims.cp_rank_of(rank)
        events = copy.deepcopy(pipeline["ranks"][pp]) if pipeline else []
        for event in events:
            for op in event.get("issue", ()):
                op["peer"] = index[dims.rank_of(op["peer"], dp, tp, cp)]
        issued = sum("issue" in e for e in events)
        groups = groups_of(rank, lay)
        for comm, what in step_collectives(rank, lay):
            members = sorted(index[g] for g in groups[comm])
            events += [{"issue": [{"op": "coll", "group": members, "msg": [what]}], "comm": comm},
                       {"wait": issued}]
            issued += 1
        ranks.append(events)
    head = pipeline or {"schedule": "none", "p": 1, "v": 1, "m": 0, "forward_only": False, "placement": "loop",
                        "per_direction": True}
    return {**{k: val for k, val in head.items() if k != "ranks"}, "ranks": ranks}
