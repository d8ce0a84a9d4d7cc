"""What the loop reports: records read in one host sync, pipeline and straggler metrics, the startup
summary, progress and validation lines."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ptdp.models import flops
from ptdp.observability import communication, straggler
from ptdp.optim.memory import memory_fields, memory_row, model_states_at_start
from ptdp.parallel.pipeline.executor import ScheduleStats
from ptdp.schedule.registry import bubble_fraction_formula
from ptdp.train.batches import to_device
from ptdp.train.evaluate import evaluate, never, perplexity
from ptdp.train.moe_metrics import moe_metrics, mtp_metrics, progress_suffix
from ptdp.train.state import TrainState


def read_records(trainer: TrainState, records: list[dict]) -> list[dict]:
    """``train_step`` records with their device scalars read, in ONE host-device sync for all of them.

    The loop calls this on logged iterations only (and before checkpoints and evaluations), with every
    record since the last call, so ``--log-interval N`` means one sync per N iterations.
    """
    scalars = [r[k] for r in records for k in ("loss", "grad_norm")]
    if all(isinstance(v, torch.Tensor) for v in scalars):
        values = torch.stack([v.reshape(()).to(torch.float64) for v in scalars]).tolist()
    else:
        values = [float(v) for v in scalars]
    out = []
    for i, r in enumerate(records):
        stats, moe, mtp = r.pop("schedule_stats", None), r.pop("moe_stats", None), r.pop("mtp_stats", None)
        r = {**r, "loss": values[2 * i], "grad_norm": values[2 * i + 1]}
        r = r if moe is None else r | moe_metrics(moe, trainer)
        r = r if mtp is None else r | mtp_metrics(mtp, trainer)
        out.append(r if stats is None else r | pipeline_metrics(trainer, stats))
    return out


def pipeline_metrics(trainer: TrainState, stats: ScheduleStats) -> dict:
    """Worst-rank bubble, in-flight microbatches and saved activation bytes.

    ``bubble_fraction`` is the fraction of the worst rank's schedule time spent waiting on communication,
    idle / (idle + busy), in [0, 1] by construction; ``bubble_fraction_formula`` is the same fraction for
    the ideal schedule, r / (1 + r) with r the paper's bubble time over ideal time, (p-1)/(v*m) (or the
    schedule's own: docs/references.md, §Schedules). The paper's ratio is not a fraction: it exceeds 1 when
    m < p - 1, and measured, the first iteration's waits (gloo's connections made on first use, the other
    ranks' first allocations) made it 1.059. Read after the iteration's sync (CUDA-event
    timings are complete); the worst rank is found with one small all-reduce (collective: every rank
    reads the same records).
    """
    plan = trainer.plan
    idle, busy = float(stats.idle_s), float(stats.busy_s)
    row = [idle / max(idle + busy, 1e-12), stats.peak_in_flight, stats.peak_saved_bytes]
    if plan.world > 1:
        worst = to_device(torch.tensor(row, dtype=torch.float64), plan.groups.device)
        communication.all_reduce(worst, op=dist.ReduceOp.MAX, action="schedule_stats")
        row = worst.tolist()
    bubble, in_flight, saved = row
    ratio = bubble_fraction_formula(plan.p, len(trainer.chunks), plan.m, plan.schedule,
                                    plan.overlap_moe_expert_parallel_comm)
    return {
        "bubble_fraction": bubble,
        "bubble_fraction_formula": ratio / (1 + ratio),
        "peak_in_flight_microbatches": int(in_flight),
        "peak_activation_bytes": int(saved),
    }


def rank_report(trainer: TrainState, schedule_stats: list[ScheduleStats | None]) -> dict:
    """The straggler report and the memory report (``model_state_bytes``, peak memory of the window per
    rank: ``ptdp.optim.memory``) in ONE all-gather of a few floats per rank, once per flushed window.

    Straggler report: the spread of the ranks' step times over the window, and the slowest rank.

    A rank's step time here is its compute time in the schedule (``busy_s``, mean over the window): the
    wall time of a step is the same on every rank of a synchronous job, since all wait for the slowest at
    the gradient all-reduce, so only the time each spent computing tells the straggler apart. Read after
    ``read_records``' sync (CUDA-event timings are complete); see ``observability/straggler.py``."""
    busy = straggler.mean_step_time([float(s.busy_s) for s in schedule_stats if s is not None])
    device = trainer.plan.groups.device
    memory = memory_row(trainer.held_states.total(trainer.params, trainer.grads, trainer.optimizer), device)
    rows = straggler.gather_rows([busy, *memory], trainer.plan.world, device)
    return {**straggler.step_time_fields([r[0] for r in rows]), **memory_fields([r[1:] for r in rows])}


def startup_summary(trainer: TrainState) -> str:
    """One line saying what is being trained, and how: the family, parameters in total and on the fullest
    rank, model-state bytes (parameters, gradients, optimizer state; Adam's moments counted before the first
    step allocates them) on the fullest rank, the layout, microbatches and tokens per iteration (collective:
    every rank calls it)."""
    from ptdp.config.presets import model_family

    cfg, plan = trainer.config, trainer.plan
    m = cfg.model
    states = model_states_at_start(trainer.params, trainer.grads, trainer.optimizer)
    rows = straggler.gather_rows([float(sum(p.numel() for p in trainer.params)), *(float(states[k]) for k in
                                  ("total", "params", "grads", "optimizer"))], plan.world, plan.groups.device)
    fullest = max(rows, key=lambda r: r[1])  # the rank holding the most model-state bytes
    padded = m.padded_vocab_size(trainer.vocab_size, plan.t)
    norm = flops.norm_parameters(m.hidden_size, m.normalization, not m.disable_bias_norm)
    moe = flops.moe_shape(m, cfg.moe)
    total = flops.model_parameter_count(m, padded, moe) + norm
    active = "" if moe is None else \
        f" ({_count(flops.model_parameter_count(m, padded, moe, active=True) + norm)} active per token)"
    tokens = cfg.training.global_batch_size * m.seq_length
    return (f" model: {model_family(m)}, {_count(total)} parameters{active} with the vocabulary padded to {padded} "
            f"({_count(max(r[0] for r in rows))} on the fullest rank) | model states on the fullest rank: "
            f"{_bytes(fullest[1])} (params {_bytes(fullest[2])}, grads {_bytes(fullest[3])}, optimizer "
            f"{_bytes(fullest[4])}) | "
            f"layout: t={plan.t} {f'c={plan.c} ' if plan.c > 1 else ''}p={plan.p} d={plan.d} v={plan.v} "
            f"schedule={plan.schedule if plan.p > 1 else 'none'} | microbatches: {plan.m} "
            f"| tokens/iteration: {tokens}")


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def validation_record(trainer: TrainState, iteration: int, is_logger: bool, split: str = "valid",
                      where: str = "", interrupted: Callable[[], bool] = never) -> dict:
    """``val_loss``/``val_ppl`` over the validation split (``split="test"``: ``test_loss``/``test_ppl`` over
    the test split), ``--eval-iters`` global batches or with ``--full-validation`` the whole validation
    split (``evaluation_iters``); empty when the split has no sample, or when ``interrupted`` (the run
    controller's stop flag) cut it short (see ``evaluate``). ``where``: Megatron's " on validation set"
    after the iteration (``--skip-train``'s lines)."""
    from ptdp.data.training_data import evaluation_iters

    dataset = getattr(trainer.data, split)
    if dataset is None:
        return {}
    iters = evaluation_iters(trainer.config, dataset) if split == "valid" else trainer.config.training.eval_iters
    if iters == 0:  # --eval-iters 0: evaluation is off, as in Megatron-LM
        return {}
    loss = evaluate(trainer, dataset, iters, interrupted)
    if loss is None:
        return {}
    if is_logger:
        print(f" {'validation' if split == 'valid' else 'test'} loss at iteration {iteration}{where} | lm loss value: "
              f"{loss:.6E} | lm loss PPL: {perplexity(loss):.6E}", flush=True)
    key = "val" if split == "valid" else "test"
    return {f"{key}_loss": loss, f"{key}_ppl": perplexity(loss)}


def evaluate_checkpoint(trainer: TrainState, iteration: int) -> dict:
    """``--skip-train`` (Megatron-LM's): no training step; the validation and the test split evaluated with
    the model as loaded, one record (also appended to ``--metrics-file``)."""
    import json

    is_logger = trainer.plan.groups.rank == 0
    if is_logger:
        print(f" skipping training (--skip-train): evaluating the model at iteration {iteration}", flush=True)
    record = {"iteration": iteration,
              **validation_record(trainer, iteration, is_logger, "valid", " on validation set"),
              **validation_record(trainer, iteration, is_logger, "test", " on test set")}
    metrics_file = trainer.config.training.metrics_file
    if metrics_file and is_logger:
        with open(metrics_file, "a") as fh:
            fh.write(json.dumps(record) + "\n")
    trainer.metrics.append(record)
    return record


def interval_loss(records: list[dict], skipped_before: int) -> float:
    """Megatron-LM's "lm loss": the mean loss over the iterations since the last progress line (``records``),
    those an fp16 overflow skipped left out (their ``skipped_iterations`` count rose; ``skipped_before``: the
    count before the first of them), all of them if every one was skipped."""
    counts = [skipped_before, *(r.get("skipped_iterations", skipped_before) for r in records)]
    advanced = [r["loss"] for r, before, after in zip(records, counts, counts[1:]) if after == before]
    losses = advanced or [r["loss"] for r in records]
    return sum(losses) / len(losses)


def progress_line(record: dict, train_iters: int, wall_s: float, first_iteration: int = 1,
                  loss: float | None = None) -> str:
    """Megatron-style progress line, plus tokens/s and an ETA (from the iterations this run has done).
    ``loss``: the "lm loss" shown, Megatron's mean over the log interval (:func:`interval_loss`); default the
    record's own."""
    it = record["iteration"]
    loss = record["loss"] if loss is None else loss
    eta = wall_s / (it - first_iteration + 1) * (train_iters - it)
    return (f" iteration {it:8d}/{train_iters:8d} | consumed samples: {record['consumed_samples']:10d} | "
            f"elapsed time per iteration (ms): {record['iteration_time_s'] * 1000:.1f} | "
            f"learning rate: {record['lr']:.3E} | lm loss: {loss:.6E} | "
            f"grad norm: {record['grad_norm']:.3f} | tokens/s: {record['tokens_per_s']:.0f} | "
            f"TFLOP/s/GPU: {record['tflops_per_gpu']:.3f}"
            + (f" (attention inside documents only: sum(l^2)/s = {record['attention_length']:.1f})"
               if "attention_length" in record else "")
            + f" | ETA: {_duration(eta)}"
            + (f" | slowest rank: {record['slowest_rank']} ({record['step_time_max_over_median']:.2f}x median)"
               if "slowest_rank" in record else "") + progress_suffix(record))


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    h, minutes = divmod(minutes, 60)
    return f"{h}:{minutes:02d}:{s:02d}"


def report_data_mix(trainer: TrainState) -> None:
    """After a resume, one line per dataset: consumed so far, left in its epoch, old -> new weight
    (ptdp/data/train_stream.py)."""
    from ptdp.data.train_stream import summary_lines

    resumed = trainer.data.train.resumed
    if resumed is None:
        print(" data: the checkpoint has no data state (an imported Megatron-LM run, or an older ptdp); reading on by iteration", flush=True)
        return
    for line in summary_lines(resumed):
        print(line, flush=True)
