"""The training loop: the PTD-P algorithm, one iteration at a time (a ``ptdp.train.steppers.Stepper``: by
default ``step.train_step``), with logging, evaluation, checkpoints (``CheckpointManager``) and the run's
lifecycle (``RunController``: signals, the NaN guard, the hang watchdog) around it."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ptdp.checkpointing import CheckpointManager
from ptdp.config import Config
from ptdp.observability.clock import Clock
from ptdp.observability.flight_recorder import run_directory
from ptdp.observability.observer import RunObserver
from ptdp.runtime import hardware
from ptdp.runtime.phases import phase
from ptdp.train.controller import RunController
from ptdp.train.report import (
    evaluate_checkpoint,
    interval_loss,
    progress_line,
    rank_report,
    read_records,
    report_data_mix,
    startup_summary,
    validation_record,
)
from ptdp.train.state import TrainState, setup
from ptdp.train.steppers import build_stepper
from ptdp.train.throughput import IterationFlops


def train(config: Config) -> list[dict]:
    """Run the whole training job on this rank; returns the per-iteration metrics (rank 0's record).

    The run controller takes over SIGTERM for the job; it gives it back however the job ends (a refused
    checkpoint included), so that a process calling ``train`` keeps its own handling afterwards."""
    trainer = setup(config)
    groups = trainer.plan.groups
    controller = RunController(groups.rank, trainer.plan.world, groups.device, groups.mesh is not None,
                               config.parallel.hang_timeout_s,
                               run_directory(config.checkpoint.save, config.training.metrics_file))
    checkpoints = None
    try:
        controller.watch(trainer.chunks)
        checkpoints = CheckpointManager(trainer)
        return _train(config, trainer, controller, checkpoints)
    finally:
        controller.close()
        if checkpoints is not None:
            checkpoints.close()


def _train(config: Config, trainer: TrainState, controller: RunController,
           checkpoints: CheckpointManager) -> list[dict]:
    """The job itself: resume, then train, log, evaluate and save until the last iteration or a stop."""
    groups = trainer.plan.groups
    with phase(f"loading the checkpoint {config.checkpoint.load}"):
        resumed = checkpoints.resume()
    controller.resumed(resumed)
    if resumed and groups.rank == 0:
        report_data_mix(trainer)
    first_iteration = resumed + 1  # data and LR are functions of the iteration alone
    tr, m = config.training, config.model
    if tr.skip_train:  # Megatron's --skip-train: evaluate the checkpoint and exit
        evaluate_checkpoint(trainer, first_iteration - 1)
        return trainer.metrics
    for chunk in trainer.chunks:
        chunk.train()
    # eq. (3) per iteration (MoE: the experts a token goes through; packed documents: the attention inside
    # them, ptdp.train.throughput); MFU counts the model's FLOPs only (no recomputation)
    counter = IterationFlops(config, trainer.vocab_size, trainer.data.train, trainer.batch_format.documents)
    recompute = m.recompute_granularity == "full"
    counted: list[int] = []  # each logged iteration's count, for the run summary's average
    peak = hardware.peak_flops_for_current_device()
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
                record.update(validation_record(trainer, it, is_logger, interrupted=controller.interrupted))
            trainer.metrics.append(record)
            observer.log(record)
            if metrics_file:
                metrics_file.write(json.dumps(record) + "\n")
        if metrics_file:
            metrics_file.flush()
        pending.clear()
        return trainer.metrics[-1]

    stepper = build_stepper(trainer)  # which iterations, and how each is trained (ptdp.train.steppers)
    iteration = None
    # the records since the last progress line: its "lm loss" is their mean (Megatron-LM's)
    printed, skipped = len(trainer.metrics), trainer.optimizer.skipped_iterations
    try:
        for iteration in stepper.iterations(first_iteration, tr.train_iters):
            controller.before_iteration(iteration)
            observer.begin_iteration(iteration)
            t0 = clock.mark()
            record = stepper.step(trainer, iteration)
            if record is None:  # not taken: the stepper yields it again
                continue
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
                if logged:
                    loss_mean = interval_loss(trainer.metrics[printed:], skipped)
                    printed, skipped = len(trainer.metrics), record.get("skipped_iterations", skipped)
                    if is_logger:
                        print(progress_line(record, tr.train_iters, time.perf_counter() - start,
                                            first_iteration, loss_mean), flush=True)
            signalled = controller.after_iteration(iteration, loss)  # agreed by every rank; NaN raises
            stop = signalled is not None or checkpoints.exit_due(iteration)
            if checkpoints.save_due(iteration) or (stop and checkpoints.saves):
                with controller.saving(iteration):
                    checkpoints.save(iteration)
                if not stop:  # a signal during the save stops here, on what was just saved
                    signalled = controller.after_save()
                    stop = signalled is not None
            if signalled:
                controller.stopped(signalled, iteration, saved=checkpoints.saves)
            if stop:
                break
        if pending:  # stopped by a signal between logged iterations
            flush()
        with controller.saving(iteration or 0):
            checkpoints.finish(iteration)
        controller.stop_watching()  # what follows (rank 0 merging traces) is no one's hang
        observer.finish(trainer.metrics, time.perf_counter() - start, sum(counted) / max(len(counted), 1),
                        checkpoints.last_saved)
    except Exception:
        controller.failed()  # a peer's hang report closed this rank's connections: exit 3 without a word
        raise
    finally:
        stepper.close()
        observer.close()
        if metrics_file:
            metrics_file.close()
    return trainer.metrics

