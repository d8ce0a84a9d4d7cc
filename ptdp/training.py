"""The training loop: the PTD-P algorithm, one iteration at a time.

    for each iteration:
        forward and backward of the m microbatches (a pipeline schedule when p > 1)
        all-reduce gradients over the data-parallel group; sync the tied embedding's two copies
        clip the global gradient norm; AdamW step with Megatron's learning-rate schedule
        log loss, lr, grad norm, throughput
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from . import flops, hardware
from .checkpointing import CheckpointManager
from .config import Config
from .data import get_microbatch
from .data.training_data import datasets_for_config
from .evaluation import evaluate, perplexity
from .fused import compile_layers
from .model import GPTModel, init_parameters, language_model_loss
from .observability import flight_recorder, straggler
from .observability.clock import Clock
from .observability.observer import RunObserver
from .observability.timeline import Timeline, span
from .optim import GradBuckets, MegatronOptimizer, learning_rate, params_dtype, setup_optimizer
from .optim.memory import memory_report
from .parallel import ParallelDims, ParallelState, init_distributed
from .phases import phase
from .pipeline.executor import ModuleStage, ScheduleStats, run_schedule
from .pipeline.p2p import P2PComm, direction_groups
from .pipeline.schedules import (
    Action,
    bubble_fraction_formula,
    build_schedule,
    schedule_placement,
    virtual_stage,
)
from .sequence_parallel import all_reduce_sequence_parallel_grads
from .tensor_parallel import model_parallel_seed
from .tensor_parallel.mappings import all_gather, all_reduce, group_size, split


@dataclass
class Trainer:
    """Everything one rank holds: its process groups, model chunks, data, gradients and optimizer."""

    config: Config
    state: ParallelState
    chunks: list[GPTModel]
    data: object
    grads: GradBuckets
    optimizer: MegatronOptimizer
    num_microbatches: int
    schedule: list[Action]
    comm: P2PComm | None
    metrics: list[dict] = field(default_factory=list)
    timeline: Timeline | None = None  # --timeline: this rank's Chrome-trace recorder
    peak_activation_bytes: int | None = None  # measured in the first iteration of the run

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for chunk in self.chunks for p in chunk.parameters()]


def build_model_chunks(config: Config, state: ParallelState, vocab_size: int, padded_vocab_size: int) -> list[GPTModel]:
    """This rank's model chunks: chunk c holds virtual stage ``virtual_stage(pp_rank, c, p, placement)``.

    Layers are split evenly over the p·v virtual stages, in the schedule's placement: Megatron's
    interleaving (with p=4, v=2 and 8 layers, rank 0 holds layers 0 and 4) or a V (zbv, v-half, v-min:
    rank 0 holds layers 0 and 7); the embedding goes on virtual stage 0 and the output layer on the last.
    """
    m, p, v = config.model, state.dims.pp, config.parallel.virtual_size
    per_stage = m.num_layers // (p * v)
    chunks = []
    for c in range(v):
        stage = virtual_stage(state.pp_rank, c, p, state.placement)
        with torch.device(state.device):  # built where it trains: no CPU copy, no host-to-device move
            chunk = GPTModel(
                m, vocab_size, padded_vocab_size, tp_group=state.tp_group,
                first_layer=stage * per_stage, num_layers=per_stage,
                pre_process=stage == 0, post_process=stage == p * v - 1,
                sequence_parallel=config.parallel.sequence_parallel,
                cp_group=state.cp_group, cp_comm_type=config.parallel.cp_comm_type,
            )
        init_parameters(chunk, config.training.seed, state.tp_rank, state.dims.tp, m.init_method_std, m.num_layers)
        chunk.to(params_dtype(config))  # --bf16/--fp16: initialised in fp32 like the fp32 model, then cast
        if getattr(config.precision, "fp8_format", None):  # issue 26: FP8 GEMMs in the layers (ptdp/fp8.py)
            from .fp8 import enable_fp8

            enable_fp8([chunk], config.precision.fp8_format, config.precision.fp8_recipe)
        if m.compile:  # on CUDA each layer is compiled whole (on the CPU only the fused element-wise ops)
            seq = local_seq_length(config, state)
            compile_layers(chunk.layers.values(), (config.training.micro_batch_size, seq, m.hidden_size),
                           params_dtype(config))
        if chunk.post_process and not chunk.pre_process and m.tied_embeddings:
            chunk.output_layer.weight.is_embedding_copy = True
        chunks.append(chunk)
    return chunks


def setup(config: Config) -> Trainer:
    par, tr = config.parallel, config.training
    rank, world_size, device = init_distributed(par.distributed_timeout_minutes)
    dims = ParallelDims(world_size, par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                        par.context_parallel_size)
    state = ParallelState(dims, rank, device, schedule_placement(par.schedule))
    model_parallel_seed(tr.seed, state.tp_rank, state.pp_rank, device)
    data = datasets_for_config(config)  # Megatron's sample order, sized by train_iters (ptdp/data/training_data.py)
    vocab_size = config.model.vocab_size or data.tokenizer.vocab_size
    padded = config.model.padded_vocab_size(vocab_size, dims.tp)
    with phase("building the model"):  # rank 0 says so when it takes more than 2 s
        chunks = build_model_chunks(config, state, vocab_size, padded)
    params = [p for chunk in chunks for p in chunk.parameters()]
    shared_embedding = [c.output_weight for c in chunks if dims.pp > 1 and (c.pre_process or c.post_process)
                        and config.model.tied_embeddings]
    grads, optimizer = setup_optimizer(params, config, state, shared_embedding)
    m = config.num_microbatches(world_size)
    schedule = build_schedule(par.schedule, dims.pp, par.virtual_size, m, state.pp_rank)
    return Trainer(config, state, chunks, data, grads, optimizer, m, schedule, build_p2p(config, state))


def local_seq_length(config: Config, state: ParallelState) -> int:
    """Tokens of one sample on this rank between layers: s/c under context parallelism, and a further
    1/t under sequence parallelism."""
    seq = config.model.seq_length // state.dims.cp
    return seq // state.dims.tp if config.parallel.sequence_parallel and state.dims.tp > 1 else seq


def build_p2p(config: Config, state: ParallelState) -> P2PComm | None:
    """Point-to-point transport between pipeline stages of boundary tensors ``[b, s/c, h]``.

    With t > 1 the scatter/gather optimisation (paper §4.1) sends only this TP rank's 1/t slice of the
    hidden dimension (every TP rank holds the same full tensor) and all-gathers it inside the receiving
    stage's TP group, cutting inter-node traffic t-fold.
    """
    if state.dims.pp == 1:
        return None
    m, tr = config.model, config.training
    t, tp_group = state.dims.tp, state.tp_group
    # Under sequence parallelism the boundary is [b, s/t, h], already split: scatter/gather is implied.
    sequence_parallel = config.parallel.sequence_parallel and t > 1
    shape = (tr.micro_batch_size, local_seq_length(config, state), m.hidden_size)
    scatter_gather = config.parallel.scatter_gather_tensors_in_pipeline and t > 1 and not sequence_parallel
    # The split is of the flat tensor (Megatron's split_tensor_into_1d_equal_chunks): a contiguous view
    # to send and one flat all-gather on arrival, no transposing copies (b·s·h is divisible by t, as h is).
    numel = shape[0] * shape[1] * shape[2]
    # The first batch_isend_irecv on a group must involve all its ranks under NCCL (torch's docs): one
    # collective over the pipeline group first, so the schedule's first batched call meets a ready group.
    dist.all_reduce(torch.zeros(1, device=state.device), group=state.pp_group)
    groups = direction_groups(state.dims, state.rank)  # issue 26: one communicator per direction
    for group in groups.values():
        dist.all_reduce(torch.zeros(1, device=state.device), group=group)
    return P2PComm(groups=groups,
        pp_ranks=state.pipeline_ranks(), shape=shape, device=state.device, group=state.pp_group,
        dtype=params_dtype(config),
        pack=(lambda x: split(x.reshape(-1), tp_group, 0)) if scatter_gather else None,
        unpack=(lambda x: all_gather(x, tp_group, 0).view(shape)) if scatter_gather else None,
        packed_shape=(numel // t,) if scatter_gather else None,
    )


def load_microbatch(trainer: Trainer, iteration: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels of one microbatch of this rank's data-parallel slice of global batch ``iteration``
    (under context parallelism, this CP rank's chunks of the same samples as the rest of its CP group)."""
    tr, state = trainer.config.training, trainer.state
    sample = get_microbatch(trainer.data.train, iteration - 1, tr.global_batch_size, state.dp_rank,
                            state.dims.dp, tr.micro_batch_size, microbatch)
    sample = to_device(sample, state.device)
    return cp_shard(sample[:, :-1], state), cp_shard(sample[:, 1:], state)


def cp_shard(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """This CP rank's load-balanced chunks of ``[b, s]`` (itself when c = 1)."""
    if state.dims.cp == 1:
        return x
    from .context_parallel import shard_sequence

    return shard_sequence(x, state.dims.cp, state.cp_rank, dim=1)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without the host waiting: to a GPU through pinned memory with
    ``non_blocking=True`` (a pageable copy is a cudaStreamSynchronize); on the CPU, itself."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def forward_backward(trainer: Trainer, iteration: int) -> tuple[torch.Tensor, ScheduleStats]:
    """Forward and backward of all m microbatches by this rank's pipeline schedule.

    Returns the mean loss (non-zero on the last stage only) and what the executor measured. Each
    microbatch's loss is scaled by 1/m, so the accumulated gradients are those of the mean loss, and by
    the fp16 loss scale (a power of two, divided out of the returned loss exactly).
    """
    state, m = trainer.state, trainer.num_microbatches
    scale = trainer.optimizer.loss_scale
    batches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def batch(j: int) -> tuple[torch.Tensor, torch.Tensor]:
        if j not in batches:  # only the first and last stage ever ask
            batches[j] = load_microbatch(trainer, iteration, j)
        return batches[j]

    def loss_fn(logits: torch.Tensor, j: int) -> torch.Tensor:
        loss = language_model_loss(logits, batch(j)[1], state.tp_group) / m
        return loss * scale if scale != 1.0 else loss

    stage = ModuleStage(trainer.chunks, state.pp_rank, state.dims.pp, len(trainer.chunks),
                        first_input=lambda j: batch(j)[0], loss_fn=loss_fn, placement=state.placement)
    recorder = trainer.timeline.record if trainer.timeline else None
    # Saved activations are the same every iteration: count them (a hook per saved tensor) only once.
    count = trainer.peak_activation_bytes is None
    stats = run_schedule(trainer.schedule, stage, trainer.comm, recorder=recorder, count_saved_bytes=count)
    if count:
        trainer.peak_activation_bytes = stats.peak_saved_bytes
    stats.peak_saved_bytes = trainer.peak_activation_bytes
    loss = total_loss(stats.losses, state.device)
    return (loss / scale if scale != 1.0 else loss), stats


def total_loss(losses: dict, device: torch.device) -> torch.Tensor:
    """The sum of the microbatch losses as a 0-dim fp32 tensor on ``device``, without reading them on the
    host: the executor keeps them as detached device tensors (plain floats are accepted too)."""
    values = [losses[k] for k in sorted(losses)]
    if not values:  # not the last stage
        return torch.zeros((), dtype=torch.float32, device=device)
    if all(isinstance(v, torch.Tensor) for v in values):
        return torch.stack([v.reshape(()).float() for v in values]).sum()
    return torch.tensor(float(sum(float(v) for v in values)), dtype=torch.float32, device=device)


def sync_embedding_grads(trainer: Trainer) -> None:
    """Sum the gradients of the tied embedding's two copies (first and last stage), as Megatron does."""
    state = trainer.state
    if not trainer.config.model.tied_embeddings:
        return
    ends = [chunk for chunk in trainer.chunks if chunk.pre_process or chunk.post_process]
    if len(ends) == 2 and state.dims.pp > 1:  # a V placement: both copies live on this rank
        first, last = (chunk.output_weight.main_grad for chunk in ends)
        first.add_(last)
        last.copy_(first)
        return
    if state.embedding_group is None:
        return
    for chunk in trainer.chunks:
        if chunk.pre_process or chunk.post_process:
            all_reduce(chunk.output_weight.main_grad, state.embedding_group)  # fp32 with --bf16


def train_step(trainer: Trainer, iteration: int) -> dict:
    cfg, state = trainer.config, trainer.state
    # Megatron steps the LR schedule only on successful updates: an fp16 overflow skips the iteration and
    # leaves the schedule where it was (skipped_iterations is restored from checkpoints).
    lr = learning_rate(iteration - trainer.optimizer.skipped_iterations, cfg.optimizer, cfg.training.train_iters)
    for group in trainer.optimizer.param_groups:
        group["lr"] = lr
    trainer.grads.start_iteration(trainer.num_microbatches)  # zero; --overlap-grad-reduce counts backwards
    loss, stats = forward_backward(trainer, iteration)
    with span(trainer.timeline, "dp_grad_all_reduce"):
        trainer.grads.finish_grad_sync()  # all-reduce, or reduce-scatter with --use-distributed-optimizer
    with span(trainer.timeline, "embedding_grad_sync"):
        sync_embedding_grads(trainer)
    with span(trainer.timeline, "sequence_parallel_grad_all_reduce"):
        all_reduce_sequence_parallel_grads(trainer.params, state.tp_group)
    with span(trainer.timeline, "optimizer_step", "compute"):  # unscale, clip, AdamW, ZeRO-1 all-gather
        grad_norm, _ = trainer.optimizer.step()
    # The loss lives on the last stage; share it with rank 0 and average it over data-parallel replicas
    # and CP ranks (each CP rank's loss is the mean over its s/c tokens of the same samples, as in Megatron).
    if group_size(state.pp_group) > 1:
        flight_recorder.record("all_reduce", group=state.pp_group, tensor=loss, action="loss")
        dist.all_reduce(loss, group=state.pp_group)
    if group_size(state.dp_cp_group) > 1:
        flight_recorder.record("all_reduce", group=state.dp_cp_group, tensor=loss, action="loss")
        dist.all_reduce(loss.div_(state.dims.dp * state.dims.cp), group=state.dp_cp_group)
    # "loss" and "grad_norm" stay 0-dim device tensors: the host does not wait for the GPU here.
    # read_records turns them into floats (and adds the pipeline metrics) once per logged iteration.
    return {"loss": loss, "lr": lr, "grad_norm": grad_norm, "loss_scale": trainer.optimizer.loss_scale,
            "skipped_iterations": trainer.optimizer.skipped_iterations, "schedule_stats": stats}


def read_records(trainer: Trainer, records: list[dict]) -> list[dict]:
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
        stats = r.pop("schedule_stats", None)
        r = {**r, "loss": values[2 * i], "grad_norm": values[2 * i + 1]}
        out.append(r if stats is None else r | pipeline_metrics(trainer, stats))
    return out


def pipeline_metrics(trainer: Trainer, stats: ScheduleStats) -> dict:
    """Worst-rank bubble (measured idle / busy time), in-flight microbatches and saved activation bytes.

    The bubble is reported beside the formula (p-1)/(v*m) (ptdp-facts.md, §Schedules), so a user sees
    what the pipeline really wastes. Read after the iteration's sync (CUDA-event timings are complete);
    the worst rank is found with one small all-reduce (collective: every rank reads the same records).
    """
    state = trainer.state
    row = [float(stats.idle_s) / max(float(stats.busy_s), 1e-12), stats.peak_in_flight, stats.peak_saved_bytes]
    if state.dims.world_size > 1:
        worst = to_device(torch.tensor(row, dtype=torch.float64), state.device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        row = worst.tolist()
    bubble, in_flight, saved = row
    return {
        "bubble_fraction": bubble,
        "bubble_fraction_formula": bubble_fraction_formula(state.dims.pp, len(trainer.chunks),
                                                          trainer.num_microbatches, trainer.config.parallel.schedule),
        "peak_in_flight_microbatches": int(in_flight),
        "peak_activation_bytes": int(saved),
    }


def straggler_report(trainer: Trainer, schedule_stats: list[ScheduleStats | None]) -> dict:
    """Spread of the ranks' step times over the flushed window, and the slowest rank (collective).

    A rank's step time here is its compute time in the schedule (``busy_s``, mean over the window): the
    wall time of a step is the same on every rank of a synchronous job, since all wait for the slowest at
    the gradient all-reduce, so only the time each spent computing tells the straggler apart. Read after
    ``read_records``' sync (CUDA-event timings are complete); see ``observability/straggler.py``.
    """
    busy = [float(s.busy_s) for s in schedule_stats if s is not None]
    return straggler.step_time_report(busy, trainer.state.dims.world_size, trainer.state.device)


def train(config: Config) -> list[dict]:
    """Run the whole training job on this rank; returns the per-iteration metrics (rank 0's record)."""
    trainer = setup(config)
    checkpoints = CheckpointManager(trainer)
    first_iteration = checkpoints.resume() + 1  # data and LR are functions of the iteration alone
    tr, m = config.training, config.model
    for chunk in trainer.chunks:
        chunk.train()
    vocab = trainer.chunks[-1].vocab_size
    iteration_flops = flops.flops_per_iteration(m.num_layers, m.hidden_size, m.seq_length, vocab,
                                                tr.global_batch_size, recompute=m.recompute_granularity == "full",
                                                ffn_hidden_size=m.ffn_size, **flops.architecture(m))
    # MFU counts the model's FLOPs only (no recomputation), tflops_per_gpu the paper's eq. (3) count.
    model_flops = flops.flops_per_iteration(m.num_layers, m.hidden_size, m.seq_length, vocab,
                                            tr.global_batch_size, recompute=False,
                                            ffn_hidden_size=m.ffn_size, **flops.architecture(m))
    peak = hardware.peak_flops_for_current_device()
    is_logger = trainer.state.rank == 0
    if tr.metrics_file and is_logger:
        Path(tr.metrics_file).parent.mkdir(parents=True, exist_ok=True)
    metrics_file = Path(tr.metrics_file).open("a") if tr.metrics_file and is_logger else None
    summary = startup_summary(trainer)
    if is_logger:
        print(summary, flush=True)
    observer = RunObserver(config, trainer.state.rank, trainer.state.dims.world_size, first_iteration,
                           trainer.state.device)
    trainer.timeline = observer.timeline
    start = time.perf_counter()
    clock = Clock(trainer.state.device)  # CUDA events on a GPU: iteration times without a host sync
    pending: list[tuple[float, float, dict]] = []  # (start mark, end mark, train_step record) not yet read

    def flush(evaluate_at: int | None = None) -> dict:
        """Read every pending record (one sync), finish, log and store them; the last one is returned."""
        schedule_stats = [r.get("schedule_stats") for _, _, r in pending]
        records = read_records(trainer, [r for _, _, r in pending])
        records[-1].update(straggler_report(trainer, schedule_stats))  # one all-gather per flush
        records[-1].update(memory_report(trainer.params, trainer.grads, trainer.optimizer, trainer.state.device))
        for (t0, t1, _), record in zip(pending, records, strict=True):
            elapsed = clock.seconds(t0, t1)
            it = record.pop("iteration")
            per_gpu = 1.0 / elapsed / trainer.state.dims.world_size
            record = {
                "iteration": it, **record, "iteration_time_s": elapsed,
                "tokens_per_s": tr.global_batch_size * m.seq_length / elapsed,
                "tflops_per_gpu": iteration_flops * per_gpu / 1e12,
                "mfu": model_flops * per_gpu / peak if peak else None,
                "consumed_samples": it * tr.global_batch_size,
            }
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
        observer.finish(trainer.metrics, time.perf_counter() - start, iteration_flops, checkpoints.last_saved)
    finally:
        observer.close()
        checkpoints.close()
        if metrics_file:
            metrics_file.close()
    return trainer.metrics


def startup_summary(trainer: Trainer) -> str:
    """One line saying what is being trained, and how: the family, parameters in total and on the fullest
    rank, the layout, microbatches and tokens per iteration (collective: every rank calls it)."""
    from .presets import model_family

    cfg, state, par = trainer.config, trainer.state, trainer.config.parallel
    m = cfg.model
    local = torch.tensor(float(sum(p.numel() for p in trainer.params)), dtype=torch.float64, device=state.device)
    if state.dims.world_size > 1:
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
    padded = m.padded_vocab_size(trainer.chunks[-1].vocab_size, state.dims.tp)
    total = flops.model_parameter_count(m, padded) + m.hidden_size * (1 if m.normalization == "RMSNorm" else 2)
    tokens = cfg.training.global_batch_size * m.seq_length
    return (f" model: {model_family(m)}, {_count(total)} parameters with the vocabulary padded to {padded} "
            f"({_count(local.item())} on the fullest rank) | "
            f"layout: t={state.dims.tp} {f'c={state.dims.cp} ' if state.dims.cp > 1 else ''}p={state.dims.pp} "
            f"d={state.dims.dp} v={par.virtual_size} "
            f"schedule={par.schedule if state.dims.pp > 1 else 'none'} | microbatches: {trainer.num_microbatches} "
            f"| tokens/iteration: {tokens}")


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def validation_record(trainer: Trainer, iteration: int, is_logger: bool) -> dict:
    """``val_loss``/``val_ppl`` over the validation split (empty when the split has no sample)."""
    if trainer.data.valid is None:
        return {}
    loss = evaluate(trainer, trainer.data.valid, trainer.config.training.eval_iters)
    if is_logger:
        print(f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | "
              f"lm loss PPL: {perplexity(loss):.6E}", flush=True)
    return {"val_loss": loss, "val_ppl": perplexity(loss)}


def progress_line(record: dict, train_iters: int, wall_s: float, first_iteration: int = 1) -> str:
    """Megatron-style progress line, plus tokens/s and an ETA (from the iterations this run has done)."""
    it = record["iteration"]
    eta = wall_s / (it - first_iteration + 1) * (train_iters - it)
    return (f" iteration {it:8d}/{train_iters:8d} | consumed samples: {record['consumed_samples']:10d} | "
            f"elapsed time per iteration (ms): {record['iteration_time_s'] * 1000:.1f} | "
            f"learning rate: {record['lr']:.3E} | lm loss: {record['loss']:.6E} | "
            f"grad norm: {record['grad_norm']:.3f} | tokens/s: {record['tokens_per_s']:.0f} | "
            f"TFLOP/s/GPU: {record['tflops_per_gpu']:.3f} | ETA: {_duration(eta)}"
            + (f" | slowest rank: {record['slowest_rank']} ({record['step_time_max_over_median']:.2f}x median)"
               if "slowest_rank" in record else ""))


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    h, minutes = divmod(minutes, 60)
    return f"{h}:{minutes:02d}:{s:02d}"
