"""The training loop's side of checkpointing: resume, periodic/exit saves, SIGTERM, and the NaN guard.

``train`` calls, in order: ``resume()`` (the iteration to continue after), ``before_iteration(i)`` and
``after_iteration(i, loss)`` around every step (the latter returns True when the run should stop), and
``finish()`` after the loop. Decisions that must be the same on every rank (a SIGTERM reached some rank;
the loss is not finite) are agreed on with one tiny all-reduce per iteration, so no rank saves or stops
alone and none is left waiting in a collective. That all-reduce is of a host tensor over a gloo group (the
default group on the CPU, one of its own on GPUs): it never touches a CUDA stream, so the host does not
wait for the GPU queue to drain (issue 26: no host synchronisation in the steady-state loop).
"""

from __future__ import annotations

import math
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ptdp.checkpointing.state import load_checkpoint, save_checkpoint
from ptdp.checkpointing.storage import CheckpointError
from ptdp.observability import flight_recorder
from ptdp.runtime import interrupt


class NonFiniteLossError(CheckpointError):
    """The loss became NaN/Inf: stop on every rank without saving over the last good checkpoint."""


class CheckpointManager:
    def __init__(self, trainer):
        self.trainer = trainer
        self.ck = trainer.config.checkpoint
        self.last_saved: int | None = None
        self.last_iteration: int | None = None  # the last iteration this process trained
        self._signalled = False
        self._previous = None
        self._stall_s: float | None = None  # the loop's stall for the last save, until reported
        self.last_stall_s: float | None = None
        self.writer = None
        self.watchdog = None
        self._first_phase = None  # ptdp.runtime.phases.Phase of the run's first iteration
        self._first_iteration: int | None = None
        # The agreement's group: host tensors over gloo, so agreeing never synchronises with a GPU stream.
        # Created by every rank alike (new_group is collective); the default group already is gloo on CPUs.
        self._agree_group = None
        groups = trainer.plan.groups
        if groups.mesh is not None and groups.device.type != "cpu":
            self._agree_group = dist.new_group(backend="gloo")
        if self.ck.save:  # every rank alike: creating the writer's process group is collective
            from ptdp.checkpointing.saver import CheckpointWriter

            self.writer = CheckpointWriter(groups.rank, trainer.plan.world, self.ck.async_save)
            if groups.rank == 0:  # a save cut short (Ctrl-C twice, a kill) left a temporary directory
                from ptdp.checkpointing.storage import remove_leftovers

                for path in remove_leftovers(self.ck.save):
                    print(f" removed {path}, left by an interrupted save", flush=True)
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        self._signalled = True  # acted on at the next iteration boundary, by every rank together

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.writer is not None and self.writer.in_flight:  # after an error: give a save in flight a chance
            try:
                self.writer.wait(timeout=60)
            except Exception:  # noqa: BLE001 - the error that brought us here matters more
                pass
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def resume(self) -> int:
        """Load ``--load`` if it holds a checkpoint; the iteration it holds (0 to start fresh)."""
        if not self.ck.load:
            return 0
        iteration = load_checkpoint(self.trainer, self.ck.load)
        interrupt.loaded(iteration)
        if not iteration and self.trainer.plan.groups.rank == 0:  # an empty DIR, or a --save DIR not saved yet
            print(f" no checkpoint in {self.ck.load}: starting from scratch", flush=True)
        if iteration and self.trainer.plan.groups.rank == 0:
            print(f" loaded checkpoint {self.ck.load} at iteration {iteration}", flush=True)
            self._report_layout_change()
            self._report_data_mix()
        return iteration

    def _report_layout_change(self) -> None:
        """Say so when the checkpoint was resharded (an elastic restart at another world size, ptdp/runtime/elastic.py)."""
        from ptdp.checkpointing.state import _layout
        from ptdp.checkpointing.storage import read_info, resolve
        from ptdp.runtime.elastic import layout_change

        trainer = self.trainer
        saved = read_info(resolve(self.ck.load))["layout"]
        line = layout_change(saved, _layout(trainer), trainer.config.training.global_batch_size,
                             trainer.plan.m)
        if line:
            print(line, flush=True)

    def _report_data_mix(self) -> None:
        """One line per dataset: consumed so far, left in its epoch, old -> new weight (ptdp/data/train_stream.py)."""
        from ptdp.data.train_stream import summary_lines

        resumed = self.trainer.data.train.resumed
        if resumed is None:
            print(" data: the checkpoint has no data state (an older ptdp); reading on by iteration", flush=True)
            return
        for line in summary_lines(resumed):
            print(line, flush=True)

    def before_iteration(self, iteration: int) -> None:
        flight_recorder.progress(iteration)
        interrupt.training(iteration)  # a first Ctrl-C from now on finishes the iteration and saves
        if self._first_phase is None:  # its one-off costs (allocation, compilation) can take a while
            from ptdp.runtime.phases import Phase

            self._first_phase = Phase(f"iteration {iteration} (the first one pays one-off costs)",
                                          rank=self.trainer.plan.groups.rank)
        timeout = self.trainer.config.parallel.hang_timeout_s
        if self._first_iteration is None:
            self._first_iteration = iteration
        if (self.watchdog is None and timeout and self.trainer.plan.world > 1
                and iteration > self._first_iteration):
            # Armed once the first iteration is done (start-up, loading and the first iteration's lazy
            # torch.compile and NCCL set-up are not watched: --distributed-timeout-minutes covers them),
            # so a long first compile is no false alarm. Progress is a host timestamp: reading it never
            # synchronises with a GPU. See flight_recorder.
            run_dir = flight_recorder.run_directory(self.ck.save, self.trainer.config.training.metrics_file)
            self.watchdog = flight_recorder.Watchdog(run_dir, self.trainer.plan.groups.rank,
                                                     self.trainer.plan.world, timeout)

    def due(self, iteration: int) -> bool:
        """Whether ``iteration`` saves or stops by schedule (the same answer on every rank). The loop reads
        the loss on the host for such iterations (and logged ones) only, so the NaN guard sees it before
        any save, while other iterations run without waiting for the GPU."""
        ck = self.ck
        return bool(ck.exit_interval and iteration % ck.exit_interval == 0) or bool(
            ck.save and ck.save_interval and iteration % ck.save_interval == 0)

    def after_iteration(self, iteration: int, loss: float | None) -> bool:
        """Save when due; True when the run must stop now (exit interval or SIGTERM, after saving).

        ``loss`` is None when the loop did not read it this iteration (see :meth:`due`): no NaN check then.
        """
        self.last_iteration = iteration
        if self._first_phase is not None:
            self._first_phase.stop()
        nonfinite = loss is not None and not math.isfinite(loss)
        signalled, sigint, nonfinite = self._agree(self._signalled, interrupt.requested(), nonfinite)
        if nonfinite:
            raise NonFiniteLossError(
                f"the loss is {loss} at iteration {iteration}; stopped without saving (the last checkpoint is "
                "kept); lower --lr, raise --lr-warmup-iters or set --clip-grad")
        exit_interval, save_interval = self.ck.exit_interval, self.ck.save_interval
        stop = signalled or sigint or bool(exit_interval and iteration % exit_interval == 0)
        if self.ck.save and (stop or (save_interval and iteration % save_interval == 0)):
            self.save(iteration)
        if sigint:  # rank 0 says so once train() returned (the save committed): ptdp.runtime.interrupt
            interrupt.stopped(iteration, saved=bool(self.ck.save))
        elif signalled and self.trainer.plan.groups.rank == 0:
            print(f" SIGTERM received: stopping after iteration {iteration}"
                  + (" (checkpoint saved)" if self.ck.save else " (no --save, nothing saved)"), flush=True)
        return stop

    def finish(self) -> None:
        """The final checkpoint at the end of training (as Megatron saves one), unless just saved."""
        if self.ck.save and self.last_iteration is not None and self.last_saved != self.last_iteration:
            self.save(self.last_iteration)
        if self.writer is not None:
            self.writer.wait()  # the last save is committed before train() returns

    def save(self, iteration: int) -> None:
        """Save ``iteration``; the loop stalls only for staging the copy with ``--async-save``."""
        start = time.perf_counter()
        flight_recorder.progress(iteration)  # a save is progress, not a hang (its collectives are DCP's)
        save_checkpoint(self.trainer, iteration, self.writer, self._committed)
        flight_recorder.progress(iteration)
        self._stall_s = self.last_stall_s = time.perf_counter() - start
        self.last_saved = iteration

    def _committed(self, iteration: int, path: Path, write_s: float) -> None:
        if self.trainer.plan.groups.rank == 0:
            stall = (f"; the loop stalled {self.last_stall_s:.3f} s" if self.writer.async_save and self.last_stall_s
                     else "")
            print(f" saved checkpoint {path} (written in {write_s:.3f} s{stall})", flush=True)

    def pop_stall(self) -> float | None:
        """Seconds the loop stalled for the save after the previous iteration (None when none): the
        ``checkpoint_stall_s`` of the next metrics record."""
        stall, self._stall_s = self._stall_s, None
        return stall

    def _agree(self, *flags: bool) -> list[bool]:
        """The OR of each flag over all ranks (one tiny all-reduce; nothing to do in a single process)."""
        if self.trainer.plan.groups.mesh is None:  # one process: no tensor, so no host-device sync either
            return [bool(f) for f in flags]
        values = torch.tensor([float(f) for f in flags])  # a host tensor: no GPU stream is involved
        flight_recorder.record("all_reduce", tensor=values, action="agree (SIGTERM, SIGINT, NaN)")
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self._agree_group)
        return [bool(v) for v in values.tolist()]
