"""The NCCL model check with expert parallelism: the MoE layers' collectives inside the pipeline schedules.

A MoE layer exchanges tokens over its expert-parallel group *inside* a forward or backward compute, on a
communicator of its own ("ep"), and the compute stream waits for each exchange (the dispatch's rows are
needed right away). The group holds ranks of the *same pipeline stage* in other pipelines (folding puts e
over the t, c and d ranks of one stage, ``ptdp.parallel.expert.dims``), which run the same action list. A
collective completes only once every member reached it, so it couples pipelines that otherwise only
communicate after the backward; this module checks that no schedule turns that coupling into a deadlock.

The trace is ``nccl_model``'s, over ``n`` copies of the pipeline (global rank ``pipe·p + r``). A collective
over group G is one issue on the "ep" communicator that sends to and receives from every other member,
followed by a compute-stream wait: under the model's rules such an issue completes exactly when every
member has started its matching issue (FIFO per pair), which is a collective's semantics. Per MoE layer:

* forward: the dispatch (alltoall: the counts, then the tokens; allgather: tokens, probabilities, choices)
  and the combine (alltoall: tokens; allgather: a reduce-scatter);
* backward (B, or the input half I of a zero-bubble schedule): the combine's and the dispatch's transposes,
  in reverse order, preceded by the forward's collectives when the layer is recomputed;
* the weight half W: none (expert weight gradients are local GEMMs).

With expert tensor parallelism under sequence parallelism (``expert_tensor=True``: etp = t, each rank holds
s/t tokens) each layer also all-gathers the routed tokens, probabilities and choices over the expert-tensor
group before the dispatch and reduce-scatters the combined output after it, on a communicator of its own
("etp", the tensor-parallel ranks of the same stage); the backward runs their transposes around the
dispatcher's.

With ``zero="optim_grads_params"`` (ZeRO-3) the trace also holds the per-chunk parameter gathers and
gradient reductions of the actions ``ptdp.schedule.param_sync.add_param_sync`` puts in the lists, as the real
gatherer over the dense and expert reducers' composite (``ptdp.parallel.data.reducer.Composite``) issues
them: each one a collective on the dense data-parallel communicator "dp"
(every pipeline's copy of the stage) and then one on the expert-data-parallel communicator "edp" (the copies with the same expert-parallel rank: pipeline k has ep rank k mod e, edp rank k // e, as
folding orders them), each with its own stream. A chunk's gathers are waited for together before its run; a
reduction is waited for right after it is issued (stricter than the transient gradient buckets, which wait
for one when they launch the next). With ``zero="optim_grads"`` (ZeRO-2) only the reductions: there the
backward hooks launch them during the chunk's last B/W pass, before anything the executor issues after it,
which is where the list's REDUCE_GRADS stands.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ptdp.models.pieces import BackwardRun, ForwardRun, fuse, interleave
from ptdp.parallel.data.zero import param_sync_handlers
from ptdp.parallel.pipeline.executor import run_schedule
from ptdp.parallel.pipeline.handlers import ActionHandler, merge_handlers
from ptdp.parallel.pipeline.overlap import has_pairs, overlap_handlers
from ptdp.schedule.actions import Action, virtual_stage
from ptdp.schedule.param_sync import add_param_sync
from ptdp.schedule.registry import build_schedule, schedule_placement
from ptdp.simulate.nccl.pairs import TP_LOSS, Label, Recorder, chunk_program
from ptdp.simulate.nccl.trace import RecordingComm, _TraceStage

FORWARD = {"alltoall": ["dispatch-counts", "dispatch-tokens", "combine-tokens"],
           "allgather": ["gather-tokens", "gather-probs", "gather-choices", "combine-reduce-scatter"]}
BACKWARD = {"alltoall": ["combine-tokens-grad", "dispatch-tokens-grad"],
            "allgather": ["combine-reduce-scatter-grad", "gather-probs-grad", "gather-tokens-grad"]}
# expert_tensor: around the dispatcher's, on the "etp" communicator
ETP_BEFORE, ETP_AFTER = ["etp-gather-tokens", "etp-gather-probs", "etp-gather-choices"], ["etp-reduce-scatter"]
ETP_BEFORE_GRAD, ETP_AFTER_GRAD = ["etp-gather-probs-grad", "etp-gather-tokens-grad"], ["etp-reduce-scatter-grad"]


class _ExpertTraceStage(_TraceStage):
    """A traced stage whose chunks hold ``moe_layers`` MoE layers each: every F, B and I first records
    its expert-parallel collectives (as placeholders; ``record_expert_trace`` turns them into issues).
    ``piecewise`` (a list with overlapped pairs): as the real stage then, every pass runs the chunk's pieces
    (``ptdp.simulate.nccl.pairs``) and a pair interleaves two microbatches' pieces and transfers."""

    def __init__(self, *args, moe_layers: int, dispatcher: str, recompute: bool, expert_tensor: bool = False,
                 piecewise: bool = False, layers: Sequence[bool] | None = None, tensor: str | None = None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.moe_layers, self.dispatcher, self.recompute = moe_layers, dispatcher, recompute
        self.expert_tensor, self.piecewise = expert_tensor, piecewise
        self.layers, self.tensor = layers, tensor
        self.recorder = Recorder(self.events)
        self._runs: dict[tuple[int, int], tuple[ForwardRun, str, Label]] = {}
        etp = expert_tensor
        self.forward_names = [*(ETP_BEFORE if etp else []), *FORWARD[dispatcher], *(ETP_AFTER if etp else [])]
        self.backward_names = [*(ETP_AFTER_GRAD if etp else []), *BACKWARD[dispatcher],
                               *(ETP_BEFORE_GRAD if etp else [])]

    def _collectives(self, op: str, chunk: int, microbatch: int) -> None:
        stage = virtual_stage(self.rank, chunk, self.p, self.placement)
        names = []
        if op == "F" or self.recompute:
            names += [(layer, f"F:{n}") for layer in range(self.moe_layers) for n in self.forward_names]
        if op in ("B", "I"):
            names += [(layer, f"{op}:{n}") for layer in reversed(range(self.moe_layers)) for n in self.backward_names]
        for layer, name in names:
            comm = "etp" if name.split(":")[1].startswith("etp") else "ep"
            self.events.append({"collective": [comm, f"{comm} {name} layer {layer}", microbatch, stage]})

    def forward(self, chunk, microbatch, input):
        if self.piecewise:
            self._pieces(chunk, microbatch).finish()
            self._loss(chunk, microbatch)
        else:
            self._collectives("F", chunk, microbatch)
        return super().forward(chunk, microbatch, input)

    def backward(self, chunk, microbatch, output_grad):
        if self.piecewise:
            self._back(Action("B", microbatch, chunk)).finish()
        else:
            self._collectives("B", chunk, microbatch)
        return super().backward(chunk, microbatch, output_grad)

    def backward_input(self, chunk, microbatch, output_grad):
        if self.piecewise:
            self._back(Action("I", microbatch, chunk)).finish()
        else:
            self._collectives("I", chunk, microbatch)
        return super().backward_input(chunk, microbatch, output_grad)

    def forward_backward(self, forward, input, backward, output_grad, saving):
        """As ``ModuleStage``'s: the two runs' pieces alternate (``ptdp.models.pieces.interleave``)."""
        if not self.piecewise:
            return super().forward_backward(forward, input, backward, output_grad, saving)
        back = self._back(backward)
        interleave(self._pieces(forward.chunk, forward.microbatch), back)
        self._loss(forward.chunk, forward.microbatch)
        y = _TraceStage.forward(self, forward.chunk, forward.microbatch, input)
        run = _TraceStage.backward if backward.op == "B" else _TraceStage.backward_input
        return y, run(self, backward.chunk, backward.microbatch, output_grad)

    def _pieces(self, chunk: int, microbatch: int) -> ForwardRun:
        stage = virtual_stage(self.rank, chunk, self.p, self.placement)
        label = Label("F", microbatch, stage)
        steps, out = chunk_program(stage == 0, stage == self.p * self.v - 1, self.moe_layers, self.dispatcher,
                                   self.expert_tensor, self.recompute, self.recorder, label, layers=self.layers,
                                   tensor=self.tensor)
        run = ForwardRun(fuse(steps), {"input": (torch.zeros(1, requires_grad=True),)})  # as ModuleStage
        self._runs[chunk, microbatch] = (run, out, label)
        return run

    def _loss(self, chunk: int, microbatch: int) -> None:
        """The vocabulary-parallel cross-entropy's all-reduces, where the last stage's forward leaves its
        pieces (``ModuleStage._exit_pieces``: after a pair's interleaved runs)."""
        stage = virtual_stage(self.rank, chunk, self.p, self.placement)
        if self.tensor and stage == self.p * self.v - 1:
            for name in TP_LOSS:
                self.recorder.sync(Label("F", microbatch, stage), name, -1)

    def _back(self, action: Action) -> BackwardRun:
        run, out, label = self._runs.pop((action.chunk, action.microbatch))
        label.op = action.op
        return BackwardRun(run, {out: (torch.ones(1),)})


class _ExpertParamSync:
    """Stands in for ``ptdp.parallel.data.zero.ChunkParamSync`` over a MoE model's reducers (a
    ``ptdp.parallel.data.protocol.ParamSync``): placeholders of its collectives on "dp" and "edp"
    (``comms``: those with peers), which ``_globalise`` gives their groups."""

    def __init__(self, events: list[dict], reshard_after_forward: bool, comms: Sequence[str], gathers: bool) -> None:
        self.events, self.reshard_after_forward, self.comms = events, reshard_after_forward, comms
        self.gathers = gathers  # ZeRO-3; ZeRO-2 only reduces
        self._gathers: dict[int, list[int]] = {}
        self._count = 0

    def handlers(self) -> dict[str, ActionHandler]:
        return param_sync_handlers(self)

    def _collective(self, what: str, chunk: int, comm: str) -> int:
        self._count += 1
        self.events.append({"zero": [self._count, comm, [what, chunk, comm]]})
        return self._count

    def gather(self, chunk: int) -> None:
        if self.gathers and chunk not in self._gathers:
            self._gathers[chunk] = [self._collective("all_gather", chunk, comm) for comm in self.comms]

    def wait(self, chunk: int) -> None:
        self.gather(chunk)
        self.events.extend({"zero-wait": ref} for ref in self._gathers.get(chunk, ()))

    def release(self, chunk: int) -> None:
        self._gathers.pop(chunk, None)

    def reduce_grads(self, chunk: int) -> None:
        for comm in self.comms:
            self.events.append({"zero-wait": self._collective("reduce_scatter", chunk, comm)})


def record_expert_trace(schedule: str, p: int, v: int, m: int, *, pipelines: int = 2, moe_layers: int = 1,
                        dispatcher: str = "alltoall", recompute: bool = False, forward_only: bool = False,
                        per_direction: bool = True, lists: Sequence[Sequence[Action]] | None = None,
                        ep_groups: Sequence[Sequence[int]] | None = None, expert_tensor: bool = False,
                        etp_groups: Sequence[Sequence[int]] | None = None, e: int | None = None,
                        zero: str | None = None, reshard_after_forward: bool = False, overlap: bool = False,
                        layers: Sequence[bool] | None = None, tensor: str | None = None) -> dict:
    """The comm trace (``nccl_model``) of ``pipelines`` data-parallel copies of ``schedule`` whose MoE
    layers exchange tokens over ``ep_groups`` (global ranks; default: groups of ``e`` consecutive pipelines'
    copies of a stage, as folding places them; ``e`` defaults to all of them). With ``expert_tensor`` the layers also gather and reduce-scatter
    over ``etp_groups`` (default: pipelines 2j and 2j+1 of a stage, the expert-parallel groups then the
    pipelines of one parity: orthogonal, as Megatron-Core's etp-ep order). ``zero`` ("optim_grads" or
    "optim_grads_params"): with ZeRO-2's reductions or ZeRO-3's gathers and reductions over the dense and
    expert data-parallel groups (module docstring). ``overlap``: the combined-1F1B lists
    (``--overlap-moe-expert-parallel-comm``); lists with overlapped pairs (those, dualpipev's) run in pieces
    (``ptdp.simulate.nccl.pairs``). ``layers``: which layers of a chunk are MoE (default ``moe_layers`` MoE
    layers). ``tensor`` ("tp", or "sp" with sequence parallelism): t = 2 over pipelines 2j and 2j+1 of a stage
    (their "tp" communicator; ``ep_groups`` then default to those ranks too, e folded over t), each layer's
    halves cut at their tensor-parallel transfers (``ptdp.simulate.nccl.pairs``); lists with pairs only.
    ``check_trace`` plays it."""
    e = e or pipelines
    zero_groups = {"dp": lambda k, r: [j * p + r for j in range(pipelines)],
                   "edp": lambda k, r: [j * p + r for j in range(k % e, pipelines, e)]}
    comms = [c for c in ("dp", "edp") if len(zero_groups[c](0, 0)) > 1]
    lists = lists or [build_schedule(schedule, p, v, m, r, forward_only, overlap=overlap) for r in range(p)]
    piecewise = any(has_pairs(actions) for actions in lists)
    if tensor and not piecewise:
        raise ValueError("tensor: the tensor-parallel transfers are traced in lists with overlapped pairs")
    if zero:  # the gathers and reductions where training places them (ZeRO-2: the gathers record nothing)
        lists = [add_param_sync(actions, reshard_after_forward) for actions in lists]
    placement = schedule_placement(schedule)
    per_rank = []
    for r in range(p):
        events: list[dict] = []
        stage = _ExpertTraceStage(r, p, v, events, placement, moe_layers=moe_layers, dispatcher=dispatcher,
                                  recompute=recompute, expert_tensor=expert_tensor, piecewise=piecewise,
                                  layers=layers, tensor=tensor)
        sync = _ExpertParamSync(events, reshard_after_forward, comms, zero == "optim_grads_params") if zero else None
        handlers = merge_handlers(overlap_handlers(), sync.handlers() if sync is not None else {})
        run_schedule(lists[r], stage, RecordingComm(r, p, events, placement, per_direction), handlers,
                     count_saved_bytes=False)
        per_rank.append(events)
    pairs = [[k * p + r for k in range(j, min(j + 2, pipelines))] for r in range(p) for j in range(0, pipelines, 2)]
    if tensor:
        ep_groups = ep_groups or pairs
    if expert_tensor:
        etp_groups = etp_groups or pairs
        ep_groups = ep_groups or [[k * p + r for k in range(parity, pipelines, 2)] for r in range(p) for parity in (0, 1)]
    ep_groups = ep_groups or [[(i + j) * p + r for j in range(e)] for r in range(p) for i in range(0, pipelines, e)]
    groups = {"ep": ep_groups, "etp": etp_groups or [], "tp": pairs if tensor else []}
    group_of = {comm: {g: group for group in found for g in group} for comm, found in groups.items()}
    ranks = []
    for k in range(pipelines):
        for r in range(p):
            me = k * p + r
            ranks.append(_globalise(per_rank[r], me, k * p, {c: g.get(me, [me]) for c, g in group_of.items()},
                                    {c: zero_groups[c](k, r) for c in comms}))
    return {"schedule": schedule, "p": p, "v": v, "m": m, "forward_only": forward_only, "placement": placement,
            "per_direction": per_direction, "pipelines": pipelines, "ranks": ranks}


def _globalise(events: list[dict], me: int, offset: int, groups: dict[str, Sequence[int]],
               zero_groups: dict[str, list[int]] | None = None) -> list[dict]:
    """One pipeline rank's events as global rank ``me``: p2p peers offset to its pipeline, issue indices
    renumbered, each collective placeholder an all-pairs issue on its communicator ("ep", "etp") over
    ``groups[comm]`` plus a wait for it (an asynchronous one's wait where its ``collective-wait`` stands),
    and each ZeRO placeholder a collective over its group in
    ``zero_groups`` (and its waits)."""
    out: list[dict] = []
    renumber: dict[int, int] = {}
    zero_issue: dict[int, int] = {}
    started: dict[int, int | None] = {}  # an asynchronous collective's placeholder -> its issue (None: no peers)
    issued = 0
    original = 0
    for event in events:
        if "issue" in event:
            ops = [{**op, "peer": op["peer"] + offset} for op in event["issue"]]
            out.append({**event, "issue": ops})
            renumber[original] = issued
            original += 1
            issued += 1
        elif "wait" in event:
            out.append({"wait": renumber[event["wait"]]})
        elif "collective" in event:
            comm, *msg = event["collective"]
            peers = [q for q in groups[comm] if q != me]
            if not peers:
                continue
            ops = [{"op": kind, "peer": q, "msg": msg} for q in peers for kind in ("send", "recv")]
            out += [{"issue": ops, "comm": comm}, {"wait": issued}]
            issued += 1
        elif "collective-start" in event:
            ref, comm, *msg = event["collective-start"]
            peers = [q for q in groups[comm] if q != me]
            started[ref] = issued if peers else None
            if peers:
                out.append({"issue": [{"op": kind, "peer": q, "msg": msg} for q in peers for kind in ("send", "recv")],
                            "comm": comm})
                issued += 1
        elif "collective-wait" in event:
            if started.get(event["collective-wait"]) is not None:
                out.append({"wait": started[event["collective-wait"]]})
        elif "zero" in event:
            ref, comm, msg = event["zero"]
            out.append({"issue": [{"op": "coll", "group": zero_groups[comm], "msg": msg}], "comm": comm})
            zero_issue[ref] = issued
            issued += 1
        elif "zero-wait" in event:
            out.append({"wait": zero_issue[event["zero-wait"]]})
        else:
            out.append(event)
    return out
