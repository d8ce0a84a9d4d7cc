"""Fault-tolerant replica groups (``--fault-tolerant-replicas R``): this rank's side of the quorum.

Each replica group is a job of its own (its own torchrun, world and store) holding a whole model copy in its
own layout (t, c, p, e, ZeRO over its d/R data-parallel ranks). Across the groups, the ranks with the same
in-group rank form torchft's managed process group, reconfigured at every quorum, and one torchft
``Manager`` per rank takes part in the quorum of each step (docs/fault-tolerance.md).

The data contract: global batch k (positions ``[k·B, (k+1)·B)``, as every layout) is cut into R shares of
B/R samples, share s being the group-level batch ``k·R + s`` of the group's B/R-sample batches. A quorum of n
groups (participating ranks 0..n-1) covers all R shares: rank r trains the shares s with ``s % n == r``
one after the other into the same gradient buffers. The sum over the quorum divided by R is then the
average over the whole global batch, whatever n is; a step is committed only when every group of the
quorum finished it (torchft's ``should_commit``), else it is redone at the next quorum. So every global
batch is trained exactly once, whole, and iteration k trains global batch k in any case: the weights
after a failure are those of the run without one. A restarted group fetches the weights, the optimizer
state and the step (which is the data position: the order is a function of the iteration) from a live
peer through torchft's checkpoint transport, at the quorum of a step boundary.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ptdp.observability import communication
from ptdp.observability.timeline import span
from ptdp.optim import learning_rate
from ptdp.runtime.replicas import GROUP_ENV
from ptdp.train.state import TrainState
from ptdp.train.step import forward_backward


def shares_of(rank: int | None, participants: int, replicas: int) -> list[int]:
    """The shares of the global batch a group of participating rank ``rank`` among ``participants``
    trains (none when it does not participate)."""
    if rank is None or participants < 1:
        return []
    return [s for s in range(replicas) if s % participants == rank]


class ReplicaSteps:
    """The iterations and the step of a replica group (a ``ptdp.train.steppers.Stepper``): :meth:`iterations`
    holds each step's quorum (and a restarted group's recovery), :meth:`step` trains its shares and commits
    them with the quorum."""

    def __init__(self, trainer: TrainState) -> None:
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        par = trainer.config.parallel
        self.replicas = par.fault_tolerant_replicas
        self.group = int(os.environ.get(GROUP_ENV, "0"))
        self.timeout_s = par.fault_tolerant_timeout_s
        timeout = timedelta(seconds=self.timeout_s)
        cpu = trainer.plan.groups.device.type == "cpu"
        pg = ProcessGroupGloo(timeout=timeout) if cpu else ProcessGroupNCCL(timeout=timeout)
        self.trainer = trainer
        host, port = self._own_store(trainer)
        self.manager = Manager(
            store_addr=host, store_port=port,
            pg=pg, load_state_dict=self._load_state, state_dict=self._state, min_replica_size=1,
            use_async_quorum=False,  # the quorum (and a recovery) before the step: its shares depend on it
            timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
            rank=trainer.plan.groups.rank, world_size=trainer.plan.world,
            replica_id=f"ptdp_replica_{self.group}", init_sync=False)  # every group initialises alike (seed)
        self.healed, self.quorum_s = False, 0.0
        self.attempts, self.last_commit = 0, time.perf_counter()  # tries of the current iteration; its start
        self.restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0

    def _own_store(self, trainer: TrainState) -> tuple[str, int]:
        """A store of this attempt for torchft's keys (its manager's address), hosted by rank 0 on a port
        the OS picks, the port broadcast to the group. Not torchrun's store: that one outlives a restart,
        and a restarted rank could read the dead manager's address from it before rank 0 replaces it."""
        import torch.distributed as dist

        host = os.environ.get("MASTER_ADDR", "localhost")
        port = torch.zeros(1, dtype=torch.int64, device=trainer.plan.groups.device)
        if trainer.plan.groups.rank == 0:
            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            port.fill_(self._store.port)
        communication.broadcast(port, src=0, action="replica_store")
        return host, int(port.item())

    def iterations(self, first: int, last: int) -> Iterator[int]:
        """The iterations to train, each after its quorum: the same one again after a step that was not
        committed, a later one after this group recovered from a peer."""
        # the step count of a resumed run: iteration = committed steps + 1
        self.manager.load_state_dict({"step": first - 1, "batches_committed": (first - 1) * self.replicas})
        start = self.manager.current_step()
        deadline = time.monotonic() + self.timeout_s
        while self.manager.current_step() < last:
            before, t0 = self.manager.current_step(), time.perf_counter()
            self.manager.start_quorum()  # synchronous: a group behind the quorum recovers here
            self.quorum_s = time.perf_counter() - t0
            self.healed = self.manager.current_step() != before
            first = self.manager.current_step() == start and self.manager.num_participants() < self.replicas
            if first and time.monotonic() < deadline:
                # the run's first step: every group is waited for (up to the timeout), so that a group still
                # starting does not find the others done. Later, the quorum is whoever is alive.
                time.sleep(0.5)
                continue
            if first and self.manager.num_participants() == 1 and self.restarted:
                # restarted by torchrun and still alone: the others finished (or are all gone); training
                # alone from the last checkpoint would repeat their steps
                if self.trainer.plan.groups.rank == 0:
                    print(f" replica group {self.group}: no live peer to recover from after "
                          f"{self.timeout_s:g} s (the other groups finished or are gone); stopping", flush=True)
                return
            deadline = 0.0
            if self.manager.current_step() >= last:
                return
            yield self.manager.current_step() + 1

    def step(self, trainer: TrainState, iteration: int) -> dict | None:
        """Train this group's shares of global batch ``iteration``, average over the quorum, commit;
        None when the quorum did not commit (the iteration is redone)."""
        cfg, manager = trainer.config, self.manager
        participants = manager.num_participants()
        shares = shares_of(manager.participating_rank(), participants, self.replicas)
        lr = learning_rate(iteration - trainer.optimizer.skipped_iterations, cfg.optimizer, cfg.training.train_iters)
        for group in trainer.optimizer.param_groups:
            group["lr"] = lr
        trainer.assembly.start_iteration(trainer.plan.m * max(len(shares), 1))
        loss = torch.zeros((), dtype=torch.float32, device=trainer.plan.groups.device)
        stats = None
        for share in shares:
            share_loss, stats = forward_backward(trainer, iteration, (iteration - 1) * self.replicas + share)
            loss = loss + share_loss
        for sync in trainer.assembly.grad_syncs:
            with span(trainer.timeline, sync.name):
                sync()
        loss = trainer.assembly.reduce_loss(loss)  # this group's shares, summed over its pipeline
        with span(trainer.timeline, "replica_all_reduce"):
            loss = self._average(trainer.optimizer.main_grads(), loss)
        self.attempts += 1
        if not manager.should_commit():
            return None
        with span(trainer.timeline, "optimizer_step", "compute"):
            grad_norm, _ = trainer.optimizer.step()
        record = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "loss_scale": trainer.optimizer.loss_scale,
                  "skipped_iterations": trainer.optimizer.skipped_iterations, "quorum_size": participants,
                  "replica_group": self.group, "replica_shares": shares, "healed": self.healed,
                  "quorum_s": self.quorum_s, "attempts": self.attempts,
                  "commit_interval_s": time.perf_counter() - self.last_commit, "sample_ranges": [self._samples(iteration, s) for s in shares]}
        if stats is not None:
            record["schedule_stats"] = stats
        for hook in trainer.assembly.step_hooks:
            record |= hook.after_step()
        self.attempts, self.last_commit = 0, time.perf_counter()
        return record

    def _samples(self, iteration: int, share: int) -> list[int]:
        """``[start, end)``: the positions in the training order of ``share`` of global batch ``iteration``
        (``ptdp samples --iteration`` lists the same global batch)."""
        size = self.trainer.batch_format.global_batch_size
        start = ((iteration - 1) * self.replicas + share) * size
        return [start, start + size]

    def _average(self, grads: list[torch.Tensor], loss: torch.Tensor) -> torch.Tensor:
        """Sum ``grads`` and ``loss`` over the quorum in one all-reduce and divide by R (every share is
        in the sum once); the loss is returned. After an error the values are garbage, and the commit fails."""
        flat = _flatten_dense_tensors([*grads, loss.reshape(1).to(grads[0].dtype if grads else loss.dtype)])
        communication.managed_all_reduce(self.manager, flat, action="replica_grads").wait()
        flat /= self.replicas
        parts = _unflatten_dense_tensors(flat, [*grads, loss.reshape(1)])
        for grad, part in zip(grads, parts, strict=False):
            grad.copy_(part)
        return parts[-1].reshape(()).float()

    # torchft's checkpoint transport: what a recovering group receives from a live peer at the same
    # in-group rank (same layout, so the same local pieces): weights, optimizer state, step counters.
    def _state(self) -> dict:
        opt = self.trainer.optimizer
        return {"params": [p.detach().clone() for p in self.trainer.params],
                "shards": [(s.main.clone(), {k: v.clone() for k, v in s.state.items()}) for s in opt.local_shards()],
                "steps": opt.steps, "skipped": opt.skipped_iterations}

    @torch.no_grad()
    def _load_state(self, state: dict) -> None:
        opt = self.trainer.optimizer
        for param, value in zip(self.trainer.params, state["params"], strict=True):
            param.copy_(value)
        states: dict = {}
        for shard, (main, fields) in zip(opt.local_shards(), state["shards"], strict=True):
            entry = states.setdefault(shard.param, {"step": torch.tensor(float(state["steps"]))})
            for key, value in (("main_param", main), *fields.items()):
                full = entry.setdefault(key, torch.zeros(shard.param.numel(), dtype=torch.float32,
                                                         device=value.device))
                full[shard.start:shard.end] = value
        if state["steps"]:  # the fp32 main weights too (not re-read from bf16 model weights)
            opt.load_state_per_param({p: {k: (v.view_as(p) if v.dim() else v) for k, v in e.items()}
                                      for p, e in states.items()})
        else:
            opt.reload_model_params()
        opt.steps, opt.skipped_iterations = state["steps"], state["skipped"]

    def close(self) -> None:
        self.manager.shutdown(wait=False)
