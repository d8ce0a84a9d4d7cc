"""``RunObserver``: the training loop's one handle on TensorBoard, Weights & Biases, the timeline and the summary.

``ptdp.train.loop.train`` calls ``begin_iteration(i)`` before each step, ``log(record)`` after it and
``finish(...)`` after the loop; every rank calls all three (the timeline is per rank and its merge needs a
barrier), while TensorBoard, W&B and the printed summary are rank 0's.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from ptdp.config import Config
from ptdp.observability import communication
from ptdp.observability.summary import run_summary, summary_line
from ptdp.observability.timeline import Timeline, merge_timelines


class RunObserver:
    def __init__(self, config: Config, rank: int, world_size: int, first_iteration: int, device: object = "cpu"):
        tr = config.training
        self.config, self.rank, self.world_size = config, rank, world_size
        self.timeline = None
        if tr.timeline:  # on a CUDA device the timeline records CUDA events (see timeline.py)
            self.timeline = Timeline(tr.timeline, rank, tr.timeline_iters, first_iteration, device)
        self._timeline_saved = False
        self.tensorboard = None
        if tr.tensorboard_dir and rank == 0:
            from ptdp.observability.tensorboard import TensorBoardLogger

            self.tensorboard = TensorBoardLogger(tr.tensorboard_dir)
        self.wandb = None
        if tr.wandb_project and rank == 0:  # the same scalars as TensorBoard, by the same rank
            from ptdp.observability.wandb_writer import WandbLogger

            self.wandb = WandbLogger(config)

    def begin_iteration(self, iteration: int) -> None:
        if self.timeline is None:
            return
        if iteration == self.timeline.last + 1:  # recorded enough: write now, not at the end of a long run
            self.save_timeline()
        self.timeline.begin_iteration(iteration)

    def log(self, record: dict) -> None:
        if self.tensorboard is not None:
            self.tensorboard.log(record)
        if self.wandb is not None:
            self.wandb.log(record)

    def save_timeline(self) -> None:
        """Every rank writes its trace; after a barrier rank 0 merges them (same iteration on every rank)."""
        if self.timeline is None or self._timeline_saved:
            return
        self.timeline.iteration = None  # stop recording
        self.timeline.save()
        if self.world_size > 1 and dist.is_initialized():
            communication.barrier(action="timeline")
        if self.rank == 0:
            path = merge_timelines(self.timeline.directory)
            print(f" timeline of iterations {self.timeline.first}-{self.timeline.last}: {path} "
                  "(open in https://ui.perfetto.dev)", flush=True)
        self._timeline_saved = True

    def finish(self, records: list[dict], wall_s: float, iteration_flops: float,
               last_saved: int | None) -> dict:
        """Write the timeline (if not yet) and print the summary on rank 0; returns the summary."""
        self.save_timeline()
        tr, ck = self.config.training, self.config.checkpoint
        checkpoint = None
        if ck.save and last_saved is not None:
            checkpoint = str(Path(ck.save) / f"iter_{last_saved:07d}")  # storage.iteration_dir's name
        summary = run_summary(records, wall_s, self.world_size, iteration_flops,
                              tr.global_batch_size * self.config.model.seq_length, checkpoint)
        if self.rank == 0 and records:
            print(summary_line(summary), flush=True)
        return summary

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None
