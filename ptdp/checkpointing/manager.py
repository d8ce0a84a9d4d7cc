"""The training loop's side of checkpointing: resume, periodic/exit saves, SIGTERM, and the NaN guard.

``train`` calls, in order: ``resume()`` (the iteration to continue after), ``before_iteration(i)`` and
``after_iteration(i, loss)`` around every step (the latter returns True when the run should stop), and
``finish()`` after the loop. Decisions that must be the same on every rank (a SIGTERM reached some rank;
the loss is not finite) are agreed on with one tiny all-reduce per iteration, so no rank saves or stops
alone and none is left waiting in a collective.
"""

from __future__ import annotations

import math
import os
import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from .state import load_checkpoint, save_checkpoint
from .storage import CheckpointError


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
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        self._signalled = True  # acted on at the next iteration boundary, by every rank together

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def resume(self) -> int:
        """Load ``--load`` if it holds a checkpoint; the iteration it holds (0 to start fresh)."""
        if not self.ck.load:
            return 0
        iteration = load_checkpoint(self.trainer, self.ck.load)
        if iteration and self.trainer.state.rank == 0:
            print(f" loaded checkpoint {self.ck.load} at iteration {iteration}", flush=True)
        return iteration

    def before_iteration(self, iteration: int) -> None:
        _test_kill_hook(self.trainer, iteration)

    def after_iteration(self, iteration: int, loss: float) -> bool:
        """Save when due; True when the run must stop now (exit interval or SIGTERM, after saving)."""
        self.last_iteration = iteration
        signalled, nonfinite = self._agree(self._signalled, not math.isfinite(loss))
        if nonfinite:
            raise NonFiniteLossError(
                f"the loss is {loss} at iteration {iteration}; stopped without saving (the last checkpoint is "
                "kept); lower --lr, raise --lr-warmup-iters or set --clip-grad")
        exit_interval, save_interval = self.ck.exit_interval, self.ck.save_interval
        stop = signalled or bool(exit_interval and iteration % exit_interval == 0)
        if self.ck.save and (stop or (save_interval and iteration % save_interval == 0)):
            self.save(iteration)
        if signalled and self.trainer.state.rank == 0:
            print(f" SIGTERM received: stopping after iteration {iteration}"
                  + (" (checkpoint saved)" if self.ck.save else " (no --save, nothing saved)"), flush=True)
        return stop

    def finish(self) -> None:
        """The final checkpoint at the end of training (as Megatron saves one), unless just saved."""
        if self.ck.save and self.last_iteration is not None and self.last_saved != self.last_iteration:
            self.save(self.last_iteration)

    def save(self, iteration: int) -> None:
        path = save_checkpoint(self.trainer, iteration)
        self.last_saved = iteration
        if self.trainer.state.rank == 0:
            print(f" saved checkpoint {path}", flush=True)

    def _agree(self, *flags: bool) -> list[bool]:
        """The OR of each flag over all ranks (one tiny all-reduce; nothing to do in a single process)."""
        values = torch.tensor([float(f) for f in flags], device=self.trainer.state.device)
        if self.trainer.state.mesh is not None:
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return [bool(v) for v in values.tolist()]


def _test_kill_hook(trainer, iteration: int) -> None:
    """Test-only: ``PTDP_TEST_KILL_AT_ITERATION=N[:TERM]`` makes one rank (``PTDP_TEST_KILL_RANK``, default
    the last) send itself SIGKILL (or SIGTERM) at the start of iteration N, once per ``--save`` directory
    (a marker file there keeps a restarted run from dying again). Not a user feature.
    """
    spec = os.environ.get("PTDP_TEST_KILL_AT_ITERATION")
    if not spec:
        return
    at, _, name = spec.partition(":")
    rank = int(os.environ.get("PTDP_TEST_KILL_RANK", trainer.state.dims.world_size - 1))
    if int(at) != iteration or trainer.state.rank != rank:
        return
    marker = Path(trainer.config.checkpoint.save or ".") / f".test-killed-{iteration}"
    if marker.exists():
        return
    marker.touch()
    os.kill(os.getpid(), getattr(signal, f"SIG{name or 'KILL'}"))
