"""The training loop's checkpoints of a :class:`~ptdp.checkpointing.interface.Checkpointable`: resume,
saves by schedule (``--save-interval``, ``--exit-interval``) and at the end, inline or in the background
(``--async-save``).

The loop calls ``resume()`` (the iteration to continue after), ``save_due(i)`` / ``exit_due(i)`` (the same
answer on every rank), ``save(i)`` (collective), ``finish(i)`` after the loop and ``close()``. When to stop
for a signal or a NaN is the run controller's (``ptdp/train/controller.py``), not this class's.
"""

from __future__ import annotations

import time
from pathlib import Path

from ptdp.checkpointing import storage
from ptdp.checkpointing.interface import Checkpointable

# ``ptdp.checkpointing.state`` (and with it ``torch.distributed.checkpoint``, DTensor and sympy: about a second
# of CPU in every process) is imported by the methods that save or load, so a run that does neither never
# pays for it (``tests/codebase/test_startup_imports.py``).


class CheckpointManager:
    def __init__(self, run: Checkpointable) -> None:
        self.run = run
        self.ck = run.config.checkpoint
        self.last_saved: int | None = None
        self._stall_s: float | None = None  # the loop's stall for the last save, until reported
        self.last_stall_s: float | None = None
        self.writer = None
        # The checkpoints of --save this run owns, the only ones --keep-last may delete: those it wrote, and
        # when --load continued the run in --save, that run's up to the one loaded (``storage.prune``).
        self.owned: set[int] = set()
        rank = run.plan.groups.rank
        if self.ck.save:  # every rank alike: creating the writer's process group is collective
            from ptdp.checkpointing.saver import CheckpointWriter

            self.writer = CheckpointWriter(rank, run.plan.world, self.ck.async_save)
            if rank == 0:  # a save cut short (Ctrl-C twice, a kill) left a temporary directory
                for path in storage.remove_leftovers(self.ck.save):
                    print(f" removed {path}, left by an interrupted save", flush=True)

    @property
    def saves(self) -> bool:
        """Whether the run saves at all (``--save``)."""
        return bool(self.ck.save)

    def close(self) -> None:
        if self.writer is not None and self.writer.in_flight:  # after an error: give a save in flight a chance
            try:
                self.writer.wait(timeout=60)
            except Exception:  # noqa: BLE001 - the error that brought us here matters more
                pass

    def resume(self) -> int:
        """Load ``--load`` if it holds a checkpoint; the iteration it holds (0 to start fresh)."""
        if not (self.ck.load or self.ck.pretrained_checkpoint):
            return 0
        from ptdp.checkpointing.state import load_checkpoint

        iteration = load_checkpoint(self.run, self.ck.load) if self.ck.load else None
        if iteration is None and self.ck.pretrained_checkpoint:  # a new fine-tuning run from a base model
            load_checkpoint(self.run, self.ck.pretrained_checkpoint, model_only=True)
            if self.run.plan.groups.rank == 0:
                print(f" loaded the model of {self.ck.pretrained_checkpoint} (--pretrained-checkpoint): training "
                      "starts with it at iteration 0", flush=True)
            return 0
        if not self.ck.load:
            return 0
        if iteration and storage.continues(self.ck.load, self.ck.save):
            self.owned.update(i for i in storage.saved_iterations(self.ck.save) if i <= iteration)
        if iteration is None and self.run.plan.groups.rank == 0:  # an empty DIR, or a --save DIR not saved yet
            print(f" no checkpoint in {self.ck.load}: starting from scratch", flush=True)
        if iteration == 0 and self.run.plan.groups.rank == 0:  # an imported model (ptdp import) or a step-0 save
            print(f" loaded the model of {self.ck.load} (iteration 0: training starts with it)", flush=True)
        if iteration and self.run.plan.groups.rank == 0:
            print(f" loaded checkpoint {self.ck.load} at iteration {iteration}", flush=True)
            self._report_layout_change()
        return iteration or 0

    def _report_layout_change(self) -> None:
        """Say so when the checkpoint was resharded (an elastic restart at another world size, ptdp/runtime/elastic.py)."""
        from ptdp.checkpointing.state import _layout
        from ptdp.runtime.elastic import layout_change

        run = self.run
        saved = storage.read_info(storage.resolve(self.ck.load))["layout"]
        line = layout_change(saved, _layout(run), run.config.training.global_batch_size, run.plan.m)
        if line:
            print(line, flush=True)

    def save_due(self, iteration: int) -> bool:
        """Whether ``--save-interval`` saves after ``iteration``."""
        return bool(self.ck.save and self.ck.save_interval and iteration % self.ck.save_interval == 0)

    def exit_due(self, iteration: int) -> bool:
        """Whether ``--exit-interval`` stops (and saves) after ``iteration``."""
        return bool(self.ck.exit_interval and iteration % self.ck.exit_interval == 0)

    def due(self, iteration: int) -> bool:
        """Whether ``iteration`` saves or stops by schedule (the same answer on every rank). The loop reads
        the loss on the host for such iterations (and logged ones) only, so the NaN guard sees it before
        any save, while other iterations run without waiting for the GPU."""
        return self.save_due(iteration) or self.exit_due(iteration)

    def finish(self, last_iteration: int | None) -> None:
        """The final checkpoint at the end of training (as Megatron saves one), unless just saved."""
        if self.ck.save and last_iteration is not None and self.last_saved != last_iteration:
            self.save(last_iteration)
        if self.writer is not None:
            self.writer.wait()  # the last save is committed before train() returns

    def save(self, iteration: int) -> None:
        """Save ``iteration``; the loop stalls only for staging the copy with ``--async-save``."""
        from ptdp.checkpointing.state import save_checkpoint

        start = time.perf_counter()
        self.owned.add(iteration)
        save_checkpoint(self.run, iteration, self.writer, self._committed, frozenset(self.owned))
        self._stall_s = self.last_stall_s = time.perf_counter() - start
        self.last_saved = iteration

    def _committed(self, iteration: int, path: Path, write_s: float) -> None:
        if self.run.plan.groups.rank == 0:
            stall = (f"; the loop stalled {self.last_stall_s:.3f} s" if self.writer.async_save and self.last_stall_s
                     else "")
            print(f" saved checkpoint {path} (written in {write_s:.3f} s{stall})", flush=True)

    def pop_stall(self) -> float | None:
        """Seconds the loop stalled for the save after the previous iteration (None when none): the
        ``checkpoint_stall_s`` of the next metrics record."""
        stall, self._stall_s = self._stall_s, None
        return stall
