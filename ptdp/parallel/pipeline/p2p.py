"""Point-to-point transport between pipeline ranks: one ``batch_isend_irecv`` per run of SEND/RECV.

The executor hands ``P2PComm`` each run of consecutive SEND/RECV actions of its list; they go out in ONE
``batch_isend_irecv`` call (Megatron's send_forward_recv_backward and its 4-op interleaved batch,
generalised; through ``ptdp.observability.communication``, which records it in the flight recorder), so a
send and the receives that stand beside it are posted together. Where the list puts
them is what makes NCCL safe (``ptdp.schedule.communication.place_communication``; ``ptdp.simulate.nccl.model``
checks the calls made here). Sends are waited on at the end of the schedule and receives when their tensor
is consumed, so communication overlaps compute. Messages between two ranks are matched first-in first-out.
On gloo the receives go out a few ahead of their batch (:meth:`P2PComm.expect`; docs/pipeline-communication.md).

``pack``/``unpack`` hooks let the caller change what travels: Megatron's scatter/gather optimisation sends
1/t of the activation and all-gathers it in the tensor-parallel group on arrival (docs/references.md,
§Communication). Activations and their gradients have the same shape, so one packed shape
serves both directions.

With ``groups={"F": ..., "B": ...}`` (two communicators over the same pipeline ranks) the
activations travel on one communicator and the gradients on the other: each run is posted as up to two
batches (activations first), each on its communicator's own NCCL stream, so a send forward never queues
behind a send backward. ``ptdp.simulate.nccl.model`` plays that layout too
(``record_comm_trace(per_direction=True)``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from ptdp.observability import communication, flight_recorder
from ptdp.schedule.actions import Action

Hook = Callable[[Tensor], Tensor]


def message_key(action: Action) -> tuple[str, int, int]:
    """Key under which a received tensor is consumed: ("F"|"B", microbatch, local chunk)."""
    return action.op[-1], action.microbatch, action.chunk


@dataclass
class _Batch:
    """Works of one batch_isend_irecv call; each work is waited exactly once (gloo hangs on a 2nd wait)."""

    works: list
    n_ops: int
    waited: set[int] = field(default_factory=set)

    def wait_for(self, index: int) -> None:
        # NCCL coalesces a batch into one work; gloo returns one work per op.
        i = index if len(self.works) == self.n_ops else 0
        if i not in self.waited and i < len(self.works):
            self.works[i].wait()
            self.waited.add(i)

    def completed(self, indices: range) -> bool:
        return all(self.works[i].is_completed() for i in indices if i < len(self.works))


@dataclass
class PendingRecv:
    """A posted receive: ``P2PComm.wait`` turns it into the (unpacked) tensor."""

    buffer: Tensor
    batch: _Batch
    index: int


@dataclass
class P2PComm:
    """Pipeline-parallel p2p over ``group``; ``pp_ranks[i]`` is the global rank of pipeline rank i.

    ``shape``/``dtype``/``device`` describe the full activation; ``packed_shape`` what ``pack`` returns
    (defaults to ``shape``). ``unpack`` restores the full tensor on the receiving side.
    """

    pp_ranks: Sequence[int]
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    group: dist.ProcessGroup | None = None
    pack: Hook | None = None
    unpack: Hook | None = None
    packed_shape: tuple[int, ...] | None = None
    groups: dict[str, dist.ProcessGroup] | None = None  # one communicator per direction: {"F": ..., "B": ...}
    ahead: int | None = None  # receives posted ahead of their batch: None = 4 on gloo, 0 on NCCL (see expect)
    received_ahead: int = 0  # receives posted before their batch was issued, over the comm's life
    _sends: list = field(default_factory=list, repr=False)
    _expected: deque = field(default_factory=deque, repr=False)  # this run's receives not posted yet, in order
    _early: dict = field(default_factory=dict, repr=False)  # message_key -> PendingRecv posted ahead

    def expect(self, actions: Sequence[Action]) -> None:
        """The run's list, before it starts: on gloo its receives are then posted up to ``ahead`` receives
        before their batch, in the list's order. gloo sends a message only once its receiver has
        posted the receive, so a receive posted in the batch right before its consumer cost a round trip
        between the two ranks' transport threads on the critical path; posted ahead, the data is there.
        Matching is unchanged (the receives go out in the same order, first-in first-out per peer) and a
        gloo operation never waits for another, so nothing can hang that could not before. NCCL runs a
        rank's p2p calls in issue order on one stream: there the lists' placement is what is proven safe
        (``ptdp.simulate.nccl.model``), and nothing is posted ahead."""
        if self.ahead is None:
            self.ahead = 4 if dist.get_backend(self._group("F")) == "gloo" else 0
        if self._early:
            raise RuntimeError(f"P2PComm: receives posted ahead were never claimed: {sorted(self._early)}")
        if self.ahead:
            self._expected = deque(a for a in actions if a.op.startswith("RECV"))

    def _group(self, kind: str) -> dist.ProcessGroup | None:
        return self.group if self.groups is None else self.groups[kind]

    def _post_ahead(self, limit: int) -> None:
        """Post the expected receives until ``limit`` are posted and not yet claimed by their batch."""
        while self._expected and len(self._early) < limit:
            action = self._expected.popleft()
            buf = torch.empty(self.packed_shape or self.shape, dtype=self.dtype, device=self.device)
            peer, group = self.pp_ranks[action.peer], self._group(action.op[-1])
            work = communication.irecv(buf, peer, group, action=repr(action))
            self._early[message_key(action)] = PendingRecv(buf, _Batch([work], 1), 0)

    def issue(self, sends: Sequence[tuple[Action, Tensor]], recvs: Sequence[Action]) -> dict:
        """Post sends and receives in one batch (one per direction with ``groups``); return
        {message_key: PendingRecv} for the receives (those posted ahead, :meth:`expect`, as they were)."""
        early = {}
        if self._expected or self._early:  # posted ahead: the batch's own first (the next expected), then more
            keys = [message_key(a) for a in recvs]
            self.received_ahead += sum(k in self._early for k in keys)
            self._post_ahead(len(self._early) + sum(k not in self._early for k in keys))
            early = {k: self._early.pop(k) for k in keys if k in self._early}
            self._post_ahead(self.ahead)
            recvs = [a for a in recvs if message_key(a) not in early]
        if self.groups is None:
            return early | self._issue(sends, recvs, self.group)
        posted = early
        for kind in ("F", "B"):  # the order ptdp.simulate.nccl.trace.RecordingComm(per_direction=True) records
            posted |= self._issue([(a, t) for a, t in sends if a.op[-1] == kind],
                                  [a for a in recvs if a.op[-1] == kind], self.groups[kind])
        return posted

    def _issue(self, sends: Sequence[tuple[Action, Tensor]], recvs: Sequence[Action], group) -> dict:
        ops: list[dist.P2POp] = []
        for action, tensor in sends:
            payload = self.pack(tensor) if self.pack is not None else tensor
            ops.append(communication.send_op(payload.contiguous(), self.pp_ranks[action.peer], group))
        buffers = []
        for action in recvs:
            buf = torch.empty(self.packed_shape or self.shape, dtype=self.dtype, device=self.device)
            buffers.append((action, buf, len(ops)))
            ops.append(communication.recv_op(buf, self.pp_ranks[action.peer], group))
        if not ops:
            return {}
        self._reap_sends()
        what = " ".join(map(repr, [a for a, _ in sends] + list(recvs)))
        batch = _Batch(communication.batch_isend_irecv(ops, group, action=what), len(ops))
        if sends:
            self._sends.append((batch, [op.tensor for op in ops[: len(sends)]]))
        return {message_key(a): PendingRecv(buf, batch, i) for a, buf, i in buffers}

    def wait(self, pending: PendingRecv) -> Tensor:
        """Block until a posted receive landed; return it unpacked."""
        flight_recorder.record("p2p_wait", group=self.group, tensor=pending.buffer, action="recv")
        pending.batch.wait_for(pending.index)
        return self.unpack(pending.buffer) if self.unpack is not None else pending.buffer

    def wait_sends(self) -> None:
        """Block until every send issued so far left (their buffers may then be freed)."""
        for batch, sent in self._sends:
            for i in range(len(sent)):
                batch.wait_for(i)
        self._sends.clear()

    def _reap_sends(self) -> None:
        """Drop the buffers of the sends gloo/NCCL are done with (each work still waited once), oldest
        first, stopping at the first still in flight: one query per call, not one per send in flight."""
        while self._sends and self._sends[0][0].completed(range(len(self._sends[0][1]))):
            batch, sent = self._sends.pop(0)
            for i in range(len(sent)):
                batch.wait_for(i)


def direction_groups(dims, rank: int) -> dict[str, dist.ProcessGroup]:
    """This rank's two pipeline communicators, {"F": activations, "B": gradients}: each a process group
    over this rank's pipeline ranks. Collective: every rank creates every pipeline's pair, in one order."""
    mine: dict[str, dist.ProcessGroup] = {}
    for dp in range(dims.dp):
        for cp in range(dims.cp):
            for tp in range(dims.tp):
                ranks = [dims.rank_of(s, dp, tp, cp) for s in range(dims.pp)]
                for kind in ("F", "B"):
                    group = dist.new_group(ranks)
                    if rank in ranks:
                        mine[kind] = group
    return mine
