"""The run's lifecycle around the training loop: signals, the NaN guard, the hang watchdog, and the one
per-iteration agreement of every rank that makes them collective decisions.

The loop calls ``before_iteration(i)`` and ``after_iteration(i, loss)`` around every step; the latter
returns why the run must stop now ("SIGINT", "SIGTERM"), or None, after every rank agreed: a signal that
reached some rank, a loss that is not finite (raised as :class:`NonFiniteLossError` on every rank) are
ORed over all ranks with one tiny all-reduce, so no rank saves or stops alone and none is left waiting in
a collective (``after_save()`` agrees once more after each save, so a signal during a save stops on it).
That all-reduce is of a host tensor over a gloo group (the default group on the CPU, one of
its own on GPUs): it never touches a CUDA stream, so the host does not wait for the GPU queue to drain
(no host synchronisation in the steady-state loop). Saving is the checkpoint manager's
(``ptdp/checkpointing/manager.py``); the loop asks both.

The watchdog (``ptdp/observability/watchdog.py``) is armed from the run's second iteration: start-up and the
first iteration (a lazy ``torch.compile``, NCCL's communicator set-up) are bounded by
``--distributed-timeout-minutes`` instead. Progress is reported per executor action and per layer
(:meth:`watch`), so a rank that computes is never called hung however long its iterations take.

It lives in ``ptdp.train`` rather than ``ptdp.runtime`` because it joins two
low packages that must not know each other: the runtime's signals, Ctrl-C state and phases, and the
observability package's watchdog, flight recorder and layer hooks (``pyproject.toml``: "ptdp.observability |
ptdp.runtime"). It is the training run's lifecycle; nothing in it reads the trainer, checkpoints,
optimizer or parallelism, which reach it only as the loop's calls.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from ptdp.config import ConfigError
from ptdp.observability import communication, flight_recorder
from ptdp.observability.liveness import DeviceProgress, watch_layers
from ptdp.observability.watchdog import Watchdog
from ptdp.runtime import interrupt
from ptdp.runtime.errors import write_line
from ptdp.runtime.phases import Phase


class NonFiniteLossError(ConfigError):
    """The loss became NaN/Inf: stop on every rank without saving over the last good checkpoint (one line,
    exit 2: the fix is in the flags)."""


class RunController:
    """One rank's run lifecycle (module docstring). ``distributed``: a process group exists (one process:
    no agreement, no watchdog). ``run_dir``: where heartbeats and hang reports go."""

    def __init__(self, rank: int, world_size: int, device: torch.device, distributed: bool,
                 hang_timeout_s: float, run_dir: Path) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.distributed, self.hang_timeout_s, self.run_dir = distributed, hang_timeout_s, run_dir
        self.watchdog: Watchdog | None = None
        self.sigterm = False
        self._previous = None
        self._first_phase: Phase | None = None
        self._first_iteration: int | None = None
        self._hooks: list = []
        # The agreement's group: host tensors over gloo, so agreeing never synchronises with a GPU stream.
        # Created by every rank alike (new_group is collective); the default group already is gloo on CPUs.
        self._agree_group = None
        if distributed and device.type != "cpu":
            self._agree_group = dist.new_group(backend="gloo")
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        if self.watching and rank == 0 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            Watchdog.forget_reports(run_dir)  # a new job; a restarted one keeps its earlier attempts' reports

    @property
    def watching(self) -> bool:
        """Whether the hang watchdog will run (more than one process and ``--hang-timeout-s`` > 0)."""
        return bool(self.hang_timeout_s) and self.world_size > 1

    def watch(self, chunks: Sequence[torch.nn.Module]) -> None:
        """Report progress per layer too (forward and backward; CPU only: a GPU reports completed work)."""
        if self.watching and self.device.type == "cpu":
            self._hooks = watch_layers(chunks)

    def _on_sigterm(self, signum, frame) -> None:
        self.sigterm = True  # acted on at the next iteration boundary, by every rank together

    def resumed(self, iteration: int) -> None:
        """The run continues after ``iteration`` (0: from scratch): what a Ctrl-C line says is on disk."""
        interrupt.loaded(iteration)

    def before_iteration(self, iteration: int) -> None:
        flight_recorder.progress(iteration)
        interrupt.training(iteration)  # a first Ctrl-C from now on finishes the iteration and saves
        if self._first_phase is None:  # its one-off costs (allocation, compilation) can take a while
            self._first_phase = Phase(f"iteration {iteration} (the first one pays one-off costs)", rank=self.rank)
        if self._first_iteration is None:
            self._first_iteration = iteration
        if self.watchdog is None and self.watching and iteration > self._first_iteration:
            device = DeviceProgress() if self.device.type == "cuda" else None
            self.watchdog = Watchdog(self.run_dir, self.rank, self.world_size, self.hang_timeout_s, device=device)

    def after_iteration(self, iteration: int, loss: float | None) -> str | None:
        """Why every rank stops after ``iteration`` ("SIGINT", "SIGTERM") or None; raises
        :class:`NonFiniteLossError` on every rank when some rank's ``loss`` is NaN/Inf (``loss`` None: the
        loop did not read it this iteration, no check)."""
        if self._first_phase is not None:
            self._first_phase.stop()
        nonfinite = loss is not None and not math.isfinite(loss)
        sigterm, sigint, nonfinite = self._agree(self.sigterm, interrupt.requested(), nonfinite)
        if nonfinite:
            value = loss if loss is not None and not math.isfinite(loss) else "not finite"
            raise NonFiniteLossError(
                f"the loss is {value} at iteration {iteration}; stopped without saving (the last checkpoint is "
                "kept); lower --lr, raise --lr-warmup-iters or set --clip-grad")
        return "SIGINT" if sigint else "SIGTERM" if sigterm else None

    def interrupted(self) -> bool:
        """Whether a Ctrl-C or SIGTERM reached any rank (collective: a long evaluation asks after each
        batch, so a stop during it is as quick as during training)."""
        return any(self._agree(self.sigterm, interrupt.requested()))

    def after_save(self) -> str | None:
        """Like :meth:`after_iteration` right after a save (one more tiny all-reduce, per save only): a
        signal that came during the save stops the run on the checkpoint just written, not one iteration
        and one save later."""
        sigterm, sigint = self._agree(self.sigterm, interrupt.requested())
        return "SIGINT" if sigint else "SIGTERM" if sigterm else None

    @contextmanager
    def saving(self, iteration: int) -> Iterator[None]:
        """A save: every rank takes part, rank 0 commits while the others wait (an announced phase)."""
        with flight_recorder.announce(f"saving the checkpoint of iteration {iteration}"):
            yield

    def stopped(self, reason: str, iteration: int, saved: bool) -> None:
        """Every rank: the run stops after ``iteration`` for ``reason``; rank 0 says so (a Ctrl-C's line
        once ``train`` returned, ``ptdp.runtime.interrupt``)."""
        if reason == "SIGINT":
            interrupt.stopped(iteration, saved=saved)
        elif self.rank == 0:
            write_line(sys.stdout, f" SIGTERM received: stopping after iteration {iteration}"
                       + (" (checkpoint saved)" if saved else " (no --save, nothing saved)"))

    def stop_watching(self) -> None:
        """The loop is over: what follows (rank 0 merging traces) is no one's hang."""
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def failed(self) -> None:
        """The loop raised: when a rank reported a hang, this is its consequence (a peer's exit closed the
        connection this rank waited on): exit 3 quietly, so the job's output is the report's one line."""
        if self.watchdog is not None:
            self.watchdog.leave_if_reported()

    def close(self) -> None:
        self.stop_watching()
        if self._first_phase is not None:
            self._first_phase.stop()
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _agree(self, *flags: bool) -> list[bool]:
        """The OR of each flag over all ranks (one tiny all-reduce; nothing to do in a single process)."""
        if not self.distributed:  # one process: no tensor, so no host-device sync either
            return [bool(f) for f in flags]
        values = torch.tensor([float(f) for f in flags])  # a host tensor: no GPU stream is involved
        communication.all_reduce(values, op=dist.ReduceOp.MAX, group=self._agree_group,
                                 action="agree (SIGTERM, SIGINT, NaN)")
        return [bool(v) for v in values.tolist()]
