"""A model of NCCL's point-to-point semantics, run on the calls the real executor makes.

gloo forgives orderings that hang NCCL, so no CPU test can show an NCCL deadlock; this model can. It
takes a *comm trace*: per pipeline rank, the host-ordered events that ``executor.run_schedule`` produced
through ``RecordingComm`` (a transport that records instead of sending):

    {"issue": [{"op": "send"|"recv", "peer": q, "msg": [kind, microbatch, sender_stage]}, ...],
     "comm": name}                       "comm" (optional, default "pp"): the communicator it goes on
    {"wait": i}                          the compute stream waits for this rank's i-th issue
    {"compute": [op, microbatch, local_chunk]}

and plays it under the semantics of docs/references.md, §NCCL (ProcessGroupNCCL, torch 2.4-2.13):

* a rank's issues on one communicator run on that communicator's NCCL stream in issue order: issue i
  starts once the previous issue on the same communicator completed and the compute stream has run
  everything the host put on it before issue i. Issues on different communicators (``P2PComm`` with one
  communicator per direction: activations "F", gradients "B") run on different streams, independently;
* a receive completes once the peer's matching send is running (its issue started); a send completes on
  its own (``sends_wait_for_receive=False``) or only once its receive is posted (``True``: NCCL promises
  no buffering); an issue (one Work) completes when all its operations did;
* ``wait`` makes the compute stream, not the host, wait for a whole issue;
* messages between two ranks on one communicator match first-in first-out;
* a collective (``{"op": "coll", "group": [ranks], "msg": ...}``, ZeRO-3's per-chunk all-gathers and
  reduce-scatters on the data-parallel communicator -- the handlers of the list's GATHER_PARAMS and
  REDUCE_GRADS actions, ``ptdp.simulate.nccl.zero`` -- ) completes once every
  member's matching collective -- its n-th on that communicator and group, carrying the same message --
  has started.

It also checks that every matched pair carries the same message and that a compute never consumes a
received tensor whose issue it has not waited for. ``check_trace`` returns the problems found (none:
deadlock-free); ``ptdp simulate --comm-trace`` writes the trace and prints the verdict.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ptdp.parallel.pipeline.executor import run_schedule
from ptdp.parallel.pipeline.handlers import ActionHandler, merge_handlers
from ptdp.parallel.pipeline.overlap import overlap_handlers
from ptdp.schedule.actions import Action, stage_location, virtual_stage
from ptdp.schedule.registry import build_schedule, schedule_placement
from ptdp.simulate.nccl.collectives import match_collectives
from ptdp.simulate.nccl.trace import RecordingComm, _TraceStage
from ptdp.simulate.nccl.vocab import VocabTraceStage

SEND_MODELS = {"sends complete on their own": False, "sends wait for their receive": True}


# ------------------------------------------------------------------------------------------- recording


class TracePlugin(Protocol):
    """Records what a plug-in's handlers communicate (``ptdp.simulate.nccl.zero.RecordingParamSync``)."""

    def handlers(self) -> Mapping[str, ActionHandler]: ...

    def finish(self) -> None:
        """After the schedule: the waits the step makes for what the handlers left running."""
        ...


def record_comm_trace(schedule: str, p: int, v: int, m: int, forward_only: bool = False,
                      lists: Sequence[Sequence[Action]] | None = None, per_direction: bool = False,
                      plugin: Callable[[RecordingComm], TracePlugin] | None = None, vocab_barriers: int = 0,
                      vocab_embeds_last: bool = False, overlap: bool = False) -> dict:
    """Run the real executor on every rank's list of ``schedule`` (or the given ``lists``) with a
    recording transport; return the comm trace (module docstring). ``per_direction``: the transport posts
    activations and gradients on two communicators, as ``P2PComm`` with ``groups`` does. ``plugin``: a
    factory ``(comm) -> TracePlugin`` whose handlers record the collectives of the lists' other actions
    (ZeRO-3's). ``vocab_barriers`` 1 or 2: with the vocabulary-parallel passes and their collectives
   ; ``vocab_embeds_last``: the last stage's forwards wait for EMB too (multi-token
    prediction). ``overlap``: the schedule's combined-1F1B lists (``--overlap-moe-expert-parallel-comm``)."""
    lists = lists or [build_schedule(schedule, p, v, m, r, forward_only, vocab_barriers, overlap) for r in range(p)]
    placement = schedule_placement(schedule)
    ranks = []
    for r in range(p):
        events: list[dict] = []
        comm = RecordingComm(r, p, events, placement, per_direction)
        stage = _TraceStage(r, p, v, events, placement)
        if vocab_barriers:
            stage = VocabTraceStage(r, p, v, events, placement, comm, vocab_barriers, vocab_embeds_last)
        recorder = plugin(comm) if plugin is not None else None
        handlers = merge_handlers(overlap_handlers(), recorder.handlers() if recorder is not None else {})
        run_schedule(lists[r], stage, comm, handlers, count_saved_bytes=False)
        if recorder is not None:
            recorder.finish()
        ranks.append(events)
    return {"schedule": schedule, "p": p, "v": v, "m": m, "forward_only": forward_only, "placement": placement,
            "per_direction": per_direction, "ranks": ranks}


# ------------------------------------------------------------------------------------------- the model


@dataclass
class _Rank:
    stream: list[Any]  # compute-stream items in host order: ("compute", ...) or ("wait", issue)
    issues: list[list[dict]]  # ops of each issue
    after: list[int]  # stream items the host had put before each issue
    comms: list[str]  # the communicator of each issue
    done: int = 0  # stream items completed
    started: set[int] = field(default_factory=set)  # issues started
    completed: set[int] = field(default_factory=set)  # issues completed
    queues: dict[str, list[int]] = field(default_factory=dict)  # each communicator's issues, in order
    heads: dict[str, int] = field(default_factory=dict)  # per communicator: how many have started

    def __post_init__(self) -> None:
        for i, comm in enumerate(self.comms):
            self.queues.setdefault(comm, []).append(i)
        self.heads = dict.fromkeys(self.queues, 0)
        self._previous = {}
        for queue in self.queues.values():
            self._previous |= dict(zip(queue[1:], queue[:-1]))

    def previous(self, i: int) -> int | None:
        """The issue before ``i`` on the same communicator (its stream runs them in order)."""
        return self._previous.get(i)


def _describe(op: dict) -> str:
    if op["op"] == "coll":
        return f"collective {op['msg']} with ranks {op.get('group', 'all')}"
    kind, mb, stage = op["msg"]
    what = f"{'activation' if kind == 'F' else 'gradient'} {kind}{mb} of stage {stage}" if kind in ("F", "B") \
        else f"{kind} of microbatch {mb} at stage {stage}"  # an expert-parallel collective (nccl_experts)
    return f"{op['op']} {what} {'to' if op['op'] == 'send' else 'from'} rank {op['peer']}"


def check_trace(trace: dict, sends_wait_for_receive: bool) -> list[str]:
    """Play ``trace`` under the NCCL model (module docstring); return the problems (empty: deadlock-free)."""
    ranks = [_split(events) for events in trace["ranks"]]
    problems: list[str] = []
    match = _match(ranks, problems)
    members = match_collectives(ranks, problems)
    problems += _unwaited_consumers(trace, ranks)

    def op_done(r: int, i: int, k: int) -> bool:
        if (r, i, k) in members:  # a collective: every member's matching issue is running
            return all(j in ranks[q].started for q, j in members[(r, i, k)])
        partner = match.get((r, i, k))
        if partner is None:
            return False
        q, j, _ = partner
        if ranks[r].issues[i][k]["op"] == "send" and not sends_wait_for_receive:
            return True
        return j in ranks[q].started  # the peer's matching operation is posted and running

    def complete(r: int, i: int) -> bool:
        rk = ranks[r]
        if i in rk.completed:
            return True
        if i in rk.started and all(op_done(r, i, k) for k in range(len(rk.issues[i]))):
            rk.completed.add(i)
            return True
        return False

    def can_start(r: int, i: int) -> bool:
        rk = ranks[r]
        before = rk.previous(i)
        return rk.done >= rk.after[i] and (before is None or complete(r, before))

    progress = True
    while progress:
        progress = False
        for r, rk in enumerate(ranks):
            while True:
                moved = False
                for comm, queue in rk.queues.items():  # each stream starts its next issue when it can
                    while rk.heads[comm] < len(queue) and can_start(r, queue[rk.heads[comm]]):
                        rk.started.add(queue[rk.heads[comm]])
                        rk.heads[comm] += 1
                        moved = True
                while rk.done < len(rk.stream):
                    item = rk.stream[rk.done]
                    if item[0] != "compute" and not complete(r, item[1]):
                        break
                    rk.done += 1
                    moved = True
                if not moved:
                    break
                progress = True
    for r, rk in enumerate(ranks):
        if rk.done == len(rk.stream) and all(complete(r, i) for i in range(len(rk.issues))):
            continue
        if rk.done < len(rk.stream):
            item = rk.stream[rk.done]
            where = f"its compute stream waits for issue #{item[1]}"
        else:
            where = "its last issues never complete"
        first = next((i for i in range(len(rk.issues)) if not complete(r, i)), None)
        if first is None:
            why = "no such issue was made"
        elif first not in rk.started:
            why = (f"issue #{first} cannot start (issue #{rk.previous(first)} on its communicator incomplete "
                   "or compute not reached)")
        else:
            stuck = [_describe(op) for k, op in enumerate(rk.issues[first]) if not op_done(r, first, k)]
            why = f"issue #{first} waits on: {'; '.join(stuck)}"
        problems.append(f"deadlock: rank {r} of {len(ranks)}: {where}; {why}")
    return problems


def _split(events: Sequence[dict]) -> _Rank:
    stream: list[Any] = []
    issues: list[list[dict]] = []
    after: list[int] = []
    comms: list[str] = []
    for event in events:
        if "issue" in event:
            issues.append(event["issue"])
            after.append(len(stream))
            comms.append(event.get("comm", "pp"))
        elif "wait" in event:
            stream.append(("wait", event["wait"]))
        else:
            stream.append(("compute", *event["compute"]))
    return _Rank(stream, issues, after, comms)


def _match(ranks: Sequence[_Rank], problems: list[str]) -> dict[tuple[int, int, int], tuple[int, int, int]]:
    """Pair the n-th send from r to q with the n-th receive on q from r (FIFO per channel: one pair of
    ranks on one communicator)."""
    queues: dict[tuple[str, int, int, str], list[tuple[int, int, int]]] = {}
    for r, rk in enumerate(ranks):
        for i, ops in enumerate(rk.issues):
            for k, op in enumerate(ops):
                if op["op"] == "coll":
                    continue
                src, dst = (r, op["peer"]) if op["op"] == "send" else (op["peer"], r)
                queues.setdefault((op["op"], src, dst, rk.comms[i]), []).append((r, i, k))
    match = {}
    for (op, src, dst, comm), ends in queues.items():
        if op != "send":
            continue
        recvs = queues.get(("recv", src, dst, comm), [])
        for a, b in zip(ends, recvs):
            sent, got = ranks[a[0]].issues[a[1]][a[2]]["msg"], ranks[b[0]].issues[b[1]][b[2]]["msg"]
            if list(sent) != list(got):
                problems.append(f"mismatch: rank {dst} issue #{b[1]} expects {got} from rank {src}, "
                                f"whose issue #{a[1]} sends {sent} (FIFO order differs)")
            match[a], match[b] = b, a
        if len(ends) != len(recvs):
            problems.append(f"unmatched: {len(ends)} sends from rank {src} to rank {dst}, {len(recvs)} receives")
    for (op, src, dst, comm), recvs in queues.items():
        if op == "recv" and ("send", src, dst, comm) not in queues:
            problems.append(f"unmatched: rank {dst} receives {len(recvs)} messages rank {src} never sends")
    return match


def _unwaited_consumers(trace: dict, ranks: Sequence[_Rank]) -> list[str]:
    """A compute that reads a received tensor must come after a wait on the issue that received it."""
    p, last, placement = trace["p"], trace["p"] * trace["v"] - 1, trace.get("placement", "loop")
    problems = []
    for rank, events in enumerate(trace["ranks"]):
        r = rank % p  # its pipeline rank (data-parallel replicas of a pipeline follow its p ranks)
        where: dict[tuple, int] = {}  # message -> issue that receives it
        waited: set[int] = set()
        issue = 0
        for event in events:
            if "issue" in event:
                for op in event["issue"]:
                    if op["op"] == "recv":
                        where[tuple(op["msg"])] = issue
                issue += 1
            elif "wait" in event:
                waited.add(event["wait"])
            else:
                op, mb, chunk = event["compute"]
                s = virtual_stage(r % p, chunk, p, placement)  # r % p: several pipelines (nccl_experts)
                if op == "F" and s > 0:
                    needed = ("F", mb, s - 1)
                elif op in ("B", "I") and s < last:
                    needed = ("B", mb, s + 1)
                else:
                    continue
                if stage_location(needed[2], p, placement)[0] != r and where.get(needed) not in waited:
                    problems.append(f"race: rank {rank} computes {op}{mb} on chunk {chunk} before waiting for "
                                    f"its input {list(needed)}")
    return problems


def check_all_send_models(trace: dict) -> dict[str, list[str]]:
    """``check_trace`` under both send models, keyed by ``SEND_MODELS`` names."""
    return {name: check_trace(trace, waits) for name, waits in SEND_MODELS.items()}


def write_trace(trace: dict, path: str | Path) -> None:
    """The trace as JSON, one line per event so a user can read it (atomic: temp file, then rename)."""
    path = Path(path)
    head = {k: trace[k] for k in ("schedule", "p", "v", "m", "forward_only", "placement", "per_direction")
            if k in trace}
    rows = ",\n".join(
        "  [\n" + ",\n".join("    " + json.dumps(e) for e in events) + "\n  ]" for events in trace["ranks"])
    text = json.dumps(head)[:-1] + ',\n "ranks": [\n' + rows + "\n ]}\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
