"""ZeRO-3's data-parallel collectives inside the pipeline schedules, under the NCCL model (``nccl_model``).

Under ZeRO-3 the executor all-gathers a chunk's parameters and reduce-scatters its gradients *between*
the pipeline's sends and receives, on another communicator (the data-parallel one). That is a new way to
hang under NCCL: a rank whose DP stream waits for a peer that waits for a pipeline message which waits for
the first rank. :func:`record_zero_trace` runs the real executor on the lists training runs (the schedule's,
with ``ptdp.schedule.param_sync.add_param_sync``'s actions) with the real handlers
(``ptdp.parallel.data.zero.param_sync_handlers``) over a gatherer that records, on every pipeline rank,
what the real one issues: each GATHER_PARAMS a collective on communicator "dp" (waited by the compute
stream at its WAIT_PARAMS), each REDUCE_GRADS a collective waited at the end of the schedule
(``finish_grad_sync``). The trace
is then copied to ``replicas`` data-parallel replicas of the pipeline (ranks ``k·p + r``), whose rank r
pairs in each collective are the DP group of pipeline rank r: identical action lists, identical
collective sequences, as on the machines. ``check_trace`` plays it like any other trace.
"""

from __future__ import annotations

import copy

from ptdp.parallel.data.zero import param_sync_handlers
from ptdp.parallel.pipeline.handlers import ActionHandler
from ptdp.schedule.param_sync import add_param_sync
from ptdp.schedule.registry import build_schedule
from ptdp.simulate.nccl.model import record_comm_trace
from ptdp.simulate.nccl.trace import RecordingComm


class RecordingParamSync:
    """Stands in for ``ptdp.parallel.data.zero.ChunkParamSync``: its collectives become trace issues on "dp"."""

    def __init__(self, comm: RecordingComm):
        self.comm = comm
        self._gathers: dict[int, int] = {}
        self._reduces: list[int] = []

    def handlers(self) -> dict[str, ActionHandler]:
        return param_sync_handlers(self)

    def _collective(self, what: str, chunk: int) -> int:
        index = self.comm._issues
        self.comm._issues += 1
        self.comm.events.append({"issue": [{"op": "coll", "group": "dp", "msg": [what, chunk]}], "comm": "dp"})
        return index

    def gather(self, chunk: int) -> None:
        if chunk not in self._gathers:
            self._gathers[chunk] = self._collective("all_gather", chunk)

    def wait(self, chunk: int) -> None:
        self.gather(chunk)
        self.comm.events.append({"wait": self._gathers[chunk]})

    def release(self, chunk: int) -> None:
        self._gathers.pop(chunk, None)

    def reduce_grads(self, chunk: int) -> None:
        self._reduces.append(self._collective("reduce_scatter", chunk))

    def finish(self) -> None:
        """``finish_grad_sync``: the compute stream waits for every reduction."""
        self.comm.events.extend({"wait": i} for i in self._reduces)


def record_zero_trace(schedule: str, p: int, v: int, m: int, reshard_after_forward: bool = False,
                      replicas: int = 2, forward_only: bool = False, per_direction: bool = True,
                      vocab_barriers: int = 0) -> dict:
    """The comm trace of ``replicas`` data-parallel copies of a ``schedule`` pipeline under ZeRO-3;
    ``vocab_barriers`` 1 or 2: with the vocabulary-parallel passes, whose collectives (communicator
    "vocab") span each replica's pipeline group while the gathers and reductions ("dp") span the DP group."""
    lists = [add_param_sync(build_schedule(schedule, p, v, m, r, forward_only, vocab_barriers), reshard_after_forward)
             for r in range(p)]
    trace = record_comm_trace(schedule, p, v, m, forward_only, lists, per_direction, RecordingParamSync,
                              vocab_barriers)
    ranks = []
    for k in range(replicas):
        for r, events in enumerate(trace["ranks"]):
            events = copy.deepcopy(events)
            for event in events:
                for op in event.get("issue", ()):
                    if op["op"] != "coll":
                        op["peer"] += k * p
                    elif event.get("comm") == "dp":
                        op["group"] = [j * p + r for j in range(replicas)]
                    else:  # the pipeline group's collectives (vocabulary barriers)
                        op["group"] = [k * p + q for q in range(p)]
            ranks.append(events)
    return {**trace, "ranks": ranks, "replicas": replicas, "zero": "optim_grads_params",
            "reshard_after_forward": reshard_after_forward}
