"""One training iteration: the schedule's forwards and backwards, gradient syncs, clip and step.

    forward and backward of the m microbatches (a pipeline schedule when p > 1)
    all-reduce gradients over the data-parallel group; sync the tied embedding's two copies;
    sum the sequence-parallel gradients over the TP group
    clip the global gradient norm; AdamW step with Megatron's learning-rate schedule
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ptdp.data import get_microbatch
from ptdp.observability import flight_recorder
from ptdp.observability.timeline import span
from ptdp.optim import learning_rate
from ptdp.parallel import ParallelState
from ptdp.parallel.collectives import group_size
from ptdp.parallel.pipeline.executor import ModuleStage, ScheduleStats, run_schedule
from ptdp.parallel.pipeline.stage import sync_embedding_grads
from ptdp.parallel.sequence.grads import all_reduce_sequence_parallel_grads
from ptdp.parallel.tensor import vocab_parallel_cross_entropy
from ptdp.parallel.vocab.stage import VocabStage
from ptdp.schedule.vocab import vocab_barriers
from ptdp.train.moe_metrics import gather_moe_stats, gather_mtp_losses, set_loss_scale, update_expert_biases
from ptdp.train.state import TrainState


def language_model_loss(logits: torch.Tensor, labels: torch.Tensor, tp_group=None,
                        inplace_backward: bool = True) -> torch.Tensor:
    """Mean next-token cross-entropy of vocabulary-parallel logits (overwrites fp32 ``logits``: see
    ``vocab_parallel_cross_entropy``, also for ``inplace_backward``)."""
    return vocab_parallel_cross_entropy(logits, labels, tp_group, inplace_backward).mean()


def load_microbatch(trainer: TrainState, iteration: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
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
    from ptdp.parallel.context.attention import shard_sequence

    return shard_sequence(x, state.dims.cp, state.cp_rank, dim=1)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without the host waiting: to a GPU through pinned memory with
    ``non_blocking=True`` (a pageable copy is a cudaStreamSynchronize); on the CPU, itself."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def forward_backward(trainer: TrainState, iteration: int) -> tuple[torch.Tensor, ScheduleStats]:
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

    set_loss_scale(trainer, scale / m)  # MoE auxiliary losses: weighted like the LM loss
    barriers = vocab_barriers(trainer.config.parallel)
    if barriers:  # issue 24: the vocabulary layers over all pipeline ranks, as S/T actions
        stage = VocabStage(trainer.chunks, state.pp_rank, state.dims.pp, len(trainer.chunks), lambda j: batch(j)[0],
                           lambda j: batch(j)[1], scale / m, m, state.placement, barriers, state.pp_group,
                           state.tp_group, state.pipeline_ranks(), trainer.config.parallel.sequence_parallel)
    else:
        stage = ModuleStage(trainer.chunks, state.pp_rank, state.dims.pp, len(trainer.chunks),
                            first_input=lambda j: batch(j)[0], loss_fn=loss_fn, placement=state.placement,
                            labels=lambda j: batch(j)[1])  # multi-token prediction's targets (issue 41)
    recorder = trainer.timeline.record if trainer.timeline else None
    # Saved activations are the same every iteration: count them (a hook per saved tensor) only once.
    count = trainer.peak_activation_bytes is None
    stats = run_schedule(trainer.schedule, stage, trainer.comm, recorder=recorder, count_saved_bytes=count,
                         param_sync=trainer.grads.param_sync)  # ZeRO-3: per-chunk gathers (ptdp.parallel.data.zero)
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


def train_step(trainer: TrainState, iteration: int) -> dict:
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
        sync_embedding_grads(trainer.chunks, state.dims.pp, state.embedding_group)
    with span(trainer.timeline, "sequence_parallel_grad_all_reduce"):
        all_reduce_sequence_parallel_grads(trainer.params, state.tp_group)
    with span(trainer.timeline, "optimizer_step", "compute"):  # unscale, clip, AdamW, ZeRO-1 all-gather
        grad_norm, _ = trainer.optimizer.step()
    update_expert_biases(trainer)  # issue 41: auxiliary-loss-free balancing, from this step's token counts
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
    record = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "loss_scale": trainer.optimizer.loss_scale,
              "skipped_iterations": trainer.optimizer.skipped_iterations, "schedule_stats": stats}
    moe, mtp = gather_moe_stats(trainer), gather_mtp_losses(trainer)  # None without experts / MTP
    return record | ({} if moe is None else {"moe_stats": moe}) | ({} if mtp is None else {"mtp_stats": mtp})
