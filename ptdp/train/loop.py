"""The training loop: the PTD-P algorithm, one iteration at a time (``step.train_step``), with logging,
evaluation, checkpoints and signals around it."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ptdp.checkpointing import CheckpointManager
from ptdp.config import Config
from ptdp.observability.clock import Clock
from ptdp.observability.observer import RunObserver
from ptdp.runtime import hardware
from ptdp.train.report import (
    evaluate_checkpoint,
    progress_line,
    rank_report,
    read_records,
    startup_summary,
    validation_record,
)
from ptdp.train.state import setup
from ptdp.train.step import train_step
from ptdp.train.throughput import IterationFlops


def train(config: Config) -> list[dict]:
    """Run the whole training job on this rank; returns the per-iteration metrics (rank 0's record)."""
    trainer = setup(config)
    checkpoints = CheckpointManager(trainer)
    first_iteration = checkpoints.resume() + 1  # data and LR are functions of the iteration alone
    tr, m = config.training, config.model
    if tr.skip_train:  # Megatron's --skip-train: evaluate the checkpoint and exit
        try:
            evaluate_checkpoint(trainer, first_iteration - 1)
        finally:
            checkpoints.close()
        return trainer.metrics
    for chunk in trainer.chunks:
        chunk.train()
    # eq. (3) per iteration (MoE: the experts a token goes through; packed documents: the attention inside
    # them, ptdp.train.throughput); MFU counts the model's FLOPs only (no recomputation)
    counter = IterationFlops(config, trainer.vocab_size, trainer.data.train, trainer.batch_format.documents)
    recompute = m.recompute_granularity == "full"
    counted: list[int] = []  # each logged iteration's count, for the run summary's average
    peak = hardware.peak_flops_for_current_device()
    groups = trainer.plan.groups
    is_logger = groups.rank == 0
    if tr.metrics_file and is_logger:
        Path(tr.metrics_file).parent.mkdir(parents=True, exist_ok=True)
    metrics_file = Path(tr.metrics_file).open("a") if tr.metrics_file and is_logger else None
    summary = startup_summary(trainer)
    if is_logger:
        print(summary, flush=True)
    observer = RunObserver(config, groups.rank, trainer.plan.world, first_iteration, groups.device)
    trainer.timeline = observer.timeline
    start = time.perf_counter()
    clock = Clock(groups.device)  # CUDA events on a GPU: iteration times without a host sync
    pending: list[tuple[float, float, dict]] = []  # (start mark, end mark, train_step record) not yet read

    def flush(evaluate_at: int | None = None) -> dict:
        """Read every pending record (one sync), finish, log and store them; the last one is returned."""
        schedule_stats = [r.get("schedule_stats") for _, _, r in pending]
        records = read_records(trainer, [r for _, _, r in pending])
        records[-1].update(rank_report(trainer, schedule_stats))  # straggler + memory: one all-gather per flush
        for (t0, t1, _), record in zip(pending, records, strict=True):
            elapsed = clock.seconds(t0, t1)
            it = record.pop("iteration")
            per_gpu = 1.0 / elapsed / trainer.plan.world
            attention = counter.attention_length(it) if is_logger else None
            counted.append(counter(recompute, attention))
            record = {
                "iteration": it, **record, "iteration_time_s": elapsed,
                "tokens_per_s": tr.global_batch_size * m.seq_length / elapsed,
                "tflops_per_gpu": counted[-1] * per_gpu / 1e12,
                "mfu": counter(False, attention) * per_gpu / peak if peak else None,
                "consumed_samples": trainer.data.train.consumed_samples(it),
            }
            if attention is not None:
                record["attention_length"] = attention
            if it == first_iteration and trainer.data.train.resumed:  # the data mix at resume (docs/data.md)
                record["data_mix"] = trainer.data.train.resumed
            if it == evaluate_at:
                record.update(validation_record(trainer, it, is_logger))
            trainer.metrics.append(record)
            observer.log(record)
            if metrics_file:
                metrics_file.write(json.dumps(record) + "\n")
        if metrics_file:
            metrics_file.flush()
        pending.clear()
        return trainer.metrics[-1]

    try:
        for iteration in range(first_iteration, tr.train_iters + 1):
            checkpoints.before_iteration(iteration)
            observer.begin_iteration(iteration)
            t0 = clock.mark()
            record = train_step(trainer, iteration)
            # checkpoint_stall_s: the loop's stall for the save after the previous iteration (None: no save)
            pending.append((t0, clock.mark(), {"iteration": iteration, **record,
                                               "checkpoint_stall_s": checkpoints.pop_stall()}))
            last = iteration == tr.train_iters
            logged = iteration % tr.log_interval == 0 or last
            evaluated = bool(tr.eval_interval) and (iteration % tr.eval_interval == 0 or last)
            loss = None  # read on the host only when logged, evaluated or a checkpoint is due
            if logged or evaluated or checkpoints.due(iteration):
                record = flush(evaluate_at=iteration if evaluated else None)
                loss = record["loss"]
                if is_logger and logged:
                    print(progress_line(record, tr.train_iters, time.perf_counter() - start, first_iteration),
                          flush=True)
            if checkpoints.after_iteration(iteration, loss):  # saves when due; NaN raises
                break
        if pending:  # stopped by SIGTERM between logged iterations
            flush()
        checkpoints.finish()
        observer.finish(trainer.metrics, time.perf_counter() - start, sum(counted) / max(len(counted), 1),
                        checkpoints.last_saved)
    finally:
        observer.close()
        checkpoints.close()
        if metrics_file:
            metrics_file.close()
    return trainer.metrics
