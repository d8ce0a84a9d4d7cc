"""The NCCL model check of ``--distribute-saved-activations`` (ZeRO-R's partitioned activation checkpointing).

With full recomputation each checkpointed unit keeps 1/t of its input; the recompute, at the start of the
unit's backward (B, or the input half I of a zero-bubble schedule; W reuses what I recomputed), all-gathers
it over the *tensor-parallel group*: the t ranks of the same pipeline stage, which run the same action
list. The gathers of one backward go unit by unit in reverse order, each waited for by the compute stream
before the unit's forward is rerun, on the tensor-parallel communicator ("tp"; the layers' own all-reduces
share it and keep the same order on every member, so they add no new ordering and are not traced).

:func:`record_partitioned_trace` records t pipelines (global rank ``k·p + r`` for tensor-parallel rank k and
pipeline rank r) so ``ptdp.simulate.nccl.model.check_trace`` plays the gathers together with the pipeline's
point-to-point traffic.
"""

from __future__ import annotations

from collections.abc import Sequence

from ptdp.parallel.pipeline.executor import run_schedule
from ptdp.parallel.pipeline.overlap import overlap_handlers
from ptdp.schedule.registry import build_schedule, schedule_placement
from ptdp.simulate.nccl.trace import RecordingComm, _TraceStage

TP_COMM = "tp"


class _PartitionedTraceStage(_TraceStage):
    """A traced stage whose chunks hold ``units`` checkpointed units: each B and I first all-gathers every
    unit's kept slice over ``tp_group`` (an issue on "tp" and the compute stream's wait for it)."""

    def __init__(self, *args, comm: RecordingComm, units: int, tp_group: Sequence[int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.comm, self.units, self.tp_group = comm, units, list(tp_group)

    def _record(self, op: str, chunk: int, microbatch: int) -> int:
        if op in ("B", "I") and len(self.tp_group) > 1:
            for unit in reversed(range(self.units)):
                index = self.comm._issues
                self.comm._issues += 1
                msg = ["recompute-gather", microbatch, chunk, unit]
                self.events += [{"issue": [{"op": "coll", "peer": None, "group": self.tp_group, "msg": msg}],
                                 "comm": TP_COMM}, {"wait": index}]
        return super()._record(op, chunk, microbatch)


def record_partitioned_trace(schedule: str, p: int, v: int, m: int, t: int, units: int = 2,
                             forward_only: bool = False, per_direction: bool = True,
                             tp_groups: Sequence[Sequence[int]] | None = None) -> dict:
    """The comm trace of ``t`` tensor-parallel copies of each pipeline rank running ``schedule``, with
    ``units`` checkpointed units per chunk gathering over ``tp_groups`` (default: each stage's t ranks, as
    ``ParallelState`` builds them)."""
    placement = schedule_placement(schedule)
    lists = [build_schedule(schedule, p, v, m, r, forward_only) for r in range(p)]
    groups = tp_groups or [[k * p + r for k in range(t)] for r in range(p)]
    group_of = {g: list(group) for group in groups for g in group}
    ranks = []
    for k in range(t):
        for r in range(p):
            me, events = k * p + r, []
            comm = RecordingComm(r, p, events, placement, per_direction)
            stage = _PartitionedTraceStage(r, p, v, events, placement, comm=comm, units=units,
                                           tp_group=group_of.get(me, [me]))
            run_schedule(lists[r], stage, comm, overlap_handlers(), count_saved_bytes=False)  # dualpipev's pairs
            for event in events:  # point-to-point peers: pipeline ranks of this tensor-parallel rank's pipeline
                for op in event.get("issue", []):
                    if op["op"] in ("send", "recv"):
                        op["peer"] += k * p
            ranks.append(events)
    return {"schedule": schedule, "p": p, "v": v, "m": m, "forward_only": forward_only, "placement": placement,
            "per_direction": per_direction, "tensor_model_parallel_size": t, "ranks": ranks}
