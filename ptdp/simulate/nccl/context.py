"""The NCCL model check of vocabulary parallelism with context parallelism.

With ``--context-parallel-size c`` each pipeline holds one sequence slice of every sample, so there are c
pipelines (one per CP rank, at fixed t and d), each running the same vocabulary-parallel lists. Two kinds
of collective then interleave on every rank:

* the vocabulary barriers (EMB, BCAST_H, C0, C1, EMB_G) over *this pipeline's* p ranks, on the pipeline
  communicator ("vocab": ``nccl_vocab``);
* the attention's exchange of keys and values over the *CP group* (the ranks of the same stage in the c
  pipelines), inside every F, B and I of a chunk, on its own communicator ("cp"), which the compute stream
  waits for before the attention can run (ring or all-gather alike: it completes once every member
  reached it). W has none: the weight gradients are local GEMMs.

A CP collective couples the c pipelines stage by stage, a vocabulary barrier couples the p stages of one
pipeline; :func:`record_context_vocab_trace` records both on c·p ranks (global rank ``k·p + r`` for CP
rank k and pipeline rank r) so ``nccl_model.check_trace`` plays them together.
"""

from __future__ import annotations

from collections.abc import Sequence

from ptdp.parallel.pipeline.executor import run_schedule
from ptdp.parallel.pipeline.overlap import overlap_handlers
from ptdp.schedule.actions import Action
from ptdp.schedule.registry import build_schedule, schedule_placement
from ptdp.simulate.nccl.trace import RecordingComm
from ptdp.simulate.nccl.vocab import VocabTraceStage

CP_COMM = "cp"


class ContextVocabTraceStage(VocabTraceStage):
    """``VocabTraceStage`` whose vocabulary collectives name this pipeline's global ranks, and whose F, B
    and I first exchange over ``cp_group`` (an issue on "cp" and the compute stream's wait for it)."""

    def __init__(self, *args, pipeline: Sequence[int], cp_group: Sequence[int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pipeline, self.cp_group = list(pipeline), list(cp_group)

    def collective(self, action: Action) -> None:
        super().collective(action)
        self.events[-1]["issue"][0]["group"] = self.pipeline

    def _record(self, op: str, chunk: int, microbatch: int) -> int:
        if op in ("F", "B", "I") and len(self.cp_group) > 1:
            index = self.comm._issues
            self.comm._issues += 1
            msg = ["cp", op, microbatch, self._stage(chunk)]
            self.events += [{"issue": [{"op": "coll", "peer": None, "group": self.cp_group, "msg": msg}],
                             "comm": CP_COMM}, {"wait": index}]
        return super()._record(op, chunk, microbatch)


def record_context_vocab_trace(schedule: str, p: int, v: int, m: int, c: int, barriers: int,
                               forward_only: bool = False, per_direction: bool = False,
                               lists: Sequence[Sequence[Sequence[Action]]] | None = None,
                               cp_groups: Sequence[Sequence[int]] | None = None) -> dict:
    """The comm trace of ``c`` pipelines (one per CP rank) running ``schedule`` with the vocabulary passes
    (``barriers`` 1 or 2). ``lists[k][r]``: CP rank k's pipeline rank r's list (default: the registry's,
    the same for every k); ``cp_groups``: global ranks exchanging keys and values (default: each stage's c
    ranks, as ``ParallelState`` builds them)."""
    placement = schedule_placement(schedule)
    default = [build_schedule(schedule, p, v, m, r, forward_only, barriers) for r in range(p)]
    groups = cp_groups or [[k * p + r for k in range(c)] for r in range(p)]
    group_of = {g: list(group) for group in groups for g in group}
    ranks = []
    for k in range(c):
        for r in range(p):
            me, events = k * p + r, []
            comm = RecordingComm(r, p, events, placement, per_direction)
            stage = ContextVocabTraceStage(r, p, v, events, placement, comm, barriers,
                                           pipeline=[k * p + q for q in range(p)], cp_group=group_of.get(me, [me]))
            run_schedule((lists[k] if lists else default)[r], stage, comm, overlap_handlers(), count_saved_bytes=False)
            for event in events:  # point-to-point peers: pipeline ranks, in this CP rank's pipeline
                for op in event.get("issue", []):
                    if op["op"] in ("send", "recv"):
                        op["peer"] += k * p
            ranks.append(events)
    return {"schedule": schedule, "p": p, "v": v, "m": m, "forward_only": forward_only, "placement": placement,
            "per_direction": per_direction, "context_parallel_size": c, "ranks": ranks}
