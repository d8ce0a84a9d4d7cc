"""Writing a checkpoint so that it neither stalls training nor breaks when a process dies mid-save.

A save has two halves. The *stage* runs in the training loop and is all the loop waits for: build this
rank's state dict (the distributed optimizer gathers its shards here, a collective on the training
groups) and copy every tensor, so training may overwrite the live ones at once. The *write* then runs
either inline or, with ``--async-save``, on a background thread:

1. rank 0 empties ``DIR/.tmp-iter_N``; barrier;
2. ``torch.distributed.checkpoint`` writes every rank's pieces there (rank 0 the ``.metadata``), then
   rank 0 adds ``ptdp.json``; barrier;
3. every rank fsyncs and sha256-hashes its share of the files (every world-th file), and the shares are
   gathered: no rank reads the whole checkpoint;
4. rank 0 writes ``checksums.sha256`` (fsynced), renames the directory to ``iter_N`` (fsync of ``DIR``),
   and only then replaces ``latest`` (write, fsync, ``os.replace``, fsync); barrier.

So ``latest`` moves only after every rank's files and the manifest are durable, and a process killed at
any moment leaves ``latest`` naming the previous complete checkpoint. All collectives of the write go
over a process group of their own (gloo), created once at start-up: a background write never interleaves
with the training loop's collectives, and at most one save is in flight (the next one, and the end of
training, wait for it first).
"""

from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from ptdp.checkpointing import storage
from ptdp.checkpointing.sharded import Boxes, BoxSavePlanner
from ptdp.observability import communication


def stage(state_dict: dict) -> dict:
    """A copy of every tensor of ``state_dict`` (DTensors keep their mesh and placements), so the live
    tensors may change while the copy is written."""
    out = {}
    for key, value in state_dict.items():
        if isinstance(value, DTensor):
            out[key] = DTensor.from_local(value.to_local().detach().clone(), value.device_mesh, value.placements,
                                          run_check=False, shape=value.shape, stride=value.stride())
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().clone()
        elif isinstance(value, Boxes):
            out[key] = value.clone()
        else:
            out[key] = value
    return out


class CheckpointWriter:
    """Runs the write half of saves, inline or on one background thread (``--async-save``)."""

    def __init__(self, rank: int, world_size: int, async_save: bool):
        self.rank, self.world_size, self.async_save = rank, world_size, async_save
        # Every rank creates it, in the same order, at start-up (new_group is collective).
        self.group = dist.new_group(backend="gloo") if world_size > 1 else None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_write_s: float | None = None

    def submit(self, root: Path, iteration: int, staged: dict, info: dict | None, keep_last: int | None,
               on_commit, ours: frozenset[int] = frozenset()) -> None:
        """Write ``staged`` as iteration ``iteration`` (``info``: rank 0's ``ptdp.json`` content); ``--keep-last``
        then prunes among ``ours``, the checkpoints of this run (``storage.prune``)."""
        self.wait()
        args = (Path(root), iteration, staged, info, keep_last, on_commit, ours)
        if not self.async_save:
            self._write(*args)
            return
        self._thread = threading.Thread(target=self._run, args=args, name=f"ptdp-save-{iteration}", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save in flight (if any) is committed; re-raise its error here."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as e:  # handed to the training thread at its next wait()
            self._error = e

    def _barrier(self) -> None:
        if self.group is not None:
            communication.barrier(group=self.group, action="checkpoint")

    def _write(self, root: Path, iteration: int, staged: dict, info: dict | None, keep_last: int | None,
               on_commit, ours: frozenset[int] = frozenset()) -> None:
        start = time.perf_counter()
        tmp = storage.temporary_dir(root, iteration)
        if self.rank == 0:
            storage.prepare_temporary(root, iteration)
        self._barrier()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
            dcp.save(staged, checkpoint_id=tmp, process_group=self.group, planner=BoxSavePlanner())
        if self.rank == 0:
            storage.write_info(tmp, info)
        self._barrier()  # every data file, .metadata and ptdp.json exist
        lines = storage.fsync_and_hash(tmp, self.rank, self.world_size)
        if self.group is not None:
            shares: list = [None] * self.world_size
            communication.all_gather_object(shares, lines, group=self.group, action="checkpoint_hashes")
            lines = [line for share in shares for line in share]
        if self.rank == 0:
            storage.commit(root, iteration, keep_last, lines, ours)
        self._barrier()  # nobody reports (or exits) before `latest` names the new checkpoint
        self.last_write_s = time.perf_counter() - start
        if on_commit is not None:
            on_commit(iteration, storage.iteration_dir(root, iteration), self.last_write_s)


def verify_data_files(directory: Path, rank: int, world_size: int) -> None:
    """Hash this rank's share of the checkpoint's data files and agree with every rank on the first bad
    one: every rank raises the same :class:`~.storage.CheckpointError` (collective), none hashes it all."""
    problem = storage.data_file_problem(directory, rank, world_size)
    if world_size > 1:
        problems: list = [None] * world_size
        communication.all_gather_object(problems, problem, action="checkpoint_verify")
        found = [p for p in problems if p is not None]
        problem = min(found) if found else None
    if problem is not None:
        raise storage.CheckpointError(problem[1])
