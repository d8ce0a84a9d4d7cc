"""What a step runs, assembled once from the parallelisms in use: the one place that names them for the step.

``parallelize.build_model_chunks`` transforms the model; :func:`assemble` then gathers what each applied
parallelism contributes to an iteration, so ``ptdp.train.step`` and ``ptdp.train.evaluate`` run it without
naming any of them:

* the action lists (``actions``): the schedule's, with the vocabulary passes (``ptdp.schedule.vocab``) and
  ZeRO-3's gathers and reductions (``ptdp.schedule.param_sync``) placed in them;
* the handlers of the actions beyond compute and communication (``handlers``: the overlapped pairs' of
  DualPipeV and combined 1F1B, ``ptdp.parallel.pipeline.overlap``; ZeRO-3's; a stage adds its own, e.g. the
  vocabulary passes');
* one stage factory for training and evaluation (``make_stage``): ``ModuleStage``, or the plug-in that
  wraps it (``ptdp.parallel.vocab.stage.VocabParallel``), running its chunks in pieces when the list holds
  overlapped pairs;
* the data-parallel gradients' start of an iteration (``start_iteration``) and the post-backward gradient
  synchronisations, in order (``grad_syncs``): the data-parallel finish (dense and expert buffers), the tied
  embedding's two copies, the sums of gradients partial over TP;
* the model's step hooks (``step_hooks``): MoE's auxiliary-loss scale before the schedule, its
  statistics and expert-bias update after the step; multi-token prediction's loss scale and losses;
* the loss's reduction over the ranks (``reduce_loss``), shared by the step and evaluation;

and, beside it, the point-to-point transport between the pipeline stages (:func:`build_p2p`). Both read
the rank's plan (``ptdp.parallel.plan``).

A new parallelism adds its contribution here (and its apply step in ``parallelize``), not a branch in the
step, evaluation or the executor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from ptdp.models.moe import moe_layer_names
from ptdp.observability import communication
from ptdp.ops.weight_grad import compute_at_once
from ptdp.parallel.collectives import all_gather, group_size, split
from ptdp.parallel.data.protocol import GradReducer
from ptdp.parallel.expert.step_hooks import MoEStepHook
from ptdp.parallel.mtp import MTPStepHook
from ptdp.parallel.pipeline.executor import PipelineStage
from ptdp.parallel.pipeline.handlers import ActionHandler, merge_handlers
from ptdp.parallel.pipeline.module_stage import BatchSource, LossFn, ModuleStage, StageLayout
from ptdp.parallel.pipeline.overlap import has_pairs, overlap_handlers, stage_options
from ptdp.parallel.pipeline.p2p import P2PComm, direction_groups
from ptdp.parallel.pipeline.stage import sync_embedding_grads, tied_embedding_weights
from ptdp.parallel.placement import Placements
from ptdp.parallel.plan import ParallelPlan
from ptdp.parallel.sequence.grads import all_reduce_tp_partial_grads
from ptdp.parallel.tensor import language_model_loss
from ptdp.parallel.vocab.stage import VocabParallel
from ptdp.schedule.actions import Action
from ptdp.schedule.param_sync import add_param_sync
from ptdp.schedule.registry import build_schedule


def stage_loss(output: Tensor, labels: Tensor, weights: Tensor | None, tp_group=None) -> Tensor:
    """The last stage's :data:`LossFn`: the vocabulary-parallel cross-entropy's mean, or its weighted sum."""
    return language_model_loss(output, labels, tp_group, weights=weights)


@dataclass(frozen=True)
class GradSync:
    """One post-backward gradient synchronisation; ``name`` is its timeline span."""

    name: str
    run: Callable[[], None]

    def __call__(self) -> None:
        self.run()


@dataclass(frozen=True)
class LossReduction:
    """The step's (or evaluation's) loss on every rank, in place: it lives on the last pipeline stage, so it
    is summed over ``pipeline`` (the pipeline group), then averaged over ``replicas`` (the data-parallel
    and CP ranks: each CP rank's loss is the mean over its s/c tokens of the same samples, as in Megatron)."""

    pipeline: Any
    replicas: Any

    def __call__(self, loss: Tensor) -> Tensor:
        if group_size(self.pipeline) > 1:
            communication.all_reduce(loss, group=self.pipeline, action="loss")
        n = group_size(self.replicas)
        if n > 1:
            communication.all_reduce(loss.div_(n), group=self.replicas, action="loss")
        return loss


class StepHook(Protocol):
    """What a model adds to each training step around the schedule."""

    def before_schedule(self, microbatch_loss_scale: float) -> None:
        """Before the schedule runs: each microbatch's loss factor (1/m times the fp16 loss scale)."""
        ...

    def after_step(self) -> dict[str, Tensor]:
        """After the optimizer step: entries for the step's record (device tensors: no host sync)."""
        ...


class StageFactory(Protocol):
    """Makes this rank's stage for one global batch (``ModuleStage`` itself is one); ``options``:
    ``ModuleStage``'s ``piecewise`` and ``delay_weight_grads`` (``ptdp.parallel.pipeline.overlap``)."""

    def __call__(self, chunks: Sequence[nn.Module], layout: StageLayout, batches: BatchSource, loss_fn: LossFn,
                 loss_scale: float = 1.0, forward_only: bool = False, **options: bool) -> PipelineStage: ...


@dataclass
class Assembly:
    """What one rank's training and evaluation steps run (module docstring)."""

    chunks: list[nn.Module]
    layout: StageLayout
    loss_fn: LossFn
    stage_factory: StageFactory
    schedule: Callable[[bool], list[Action]]  # forward_only -> this rank's action list
    reduce_loss: LossReduction
    grads: GradReducer  # the data-parallel reducer (ptdp.parallel.gradients) this assembly drives
    handlers: Mapping[str, ActionHandler] = field(default_factory=dict)
    grad_syncs: list[GradSync] = field(default_factory=list)
    step_hooks: list[StepHook] = field(default_factory=list)
    overlap: bool = False  # the training list holds overlapped pairs: its stage runs in pieces
    delay_weight_grads: bool = False  # --delay-wgrad-compute

    def start_iteration(self, backwards: int) -> None:
        """Before an iteration's schedule: the data-parallel gradients zeroed, and a bucket reduced once each
        of its parameters had ``backwards`` backwards (the microbatches, under ``--overlap-grad-reduce``)."""
        self.grads.start_iteration(backwards)

    def actions(self, forward_only: bool = False) -> list[Action]:
        """This rank's action list for one iteration (``forward_only``: evaluation's)."""
        return self.schedule(forward_only)

    def make_stage(self, batches: BatchSource, loss_scale: float = 1.0, forward_only: bool = False) -> PipelineStage:
        """The stage that runs one global batch ``batches``; ``loss_scale`` multiplies each microbatch's loss.
        Every rank calls it before the schedule, so the batch source's own collectives run here
        (``BatchSource.begin``: the per-token loss's global count)."""
        batches.begin()
        options = stage_options(self.overlap and not forward_only, self.delay_weight_grads)
        return self.stage_factory(self.chunks, self.layout, batches, self.loss_fn, loss_scale, forward_only,
                                  **options)


def assemble(plan: ParallelPlan, chunks: Sequence[nn.Module], grads: GradReducer, placements: Placements) -> Assembly:
    """The :class:`Assembly` of this rank's ``chunks`` and their ``placements`` (``build_model_chunks``) and
    ``grads`` (the data-parallel reducer, ``ptdp.parallel.gradients``: zeroed by :meth:`Assembly.start_iteration`,
    its ZeRO-3 ``param_sync`` places and runs the gather actions, its ``finish_grad_sync`` is the first gradient
    sync), as ``plan`` resolves them."""
    g, p = plan.groups, plan.p
    layout = StageLayout(g.pp_rank, p, len(chunks), plan.placement,
                         labels_to_last=bool(plan.model.mtp_num_layers))  # MTP reads the labels
    barriers = plan.vocab_barriers
    stage_factory: StageFactory = ModuleStage
    if barriers:  # the vocabulary layers over all pipeline ranks, as S/T actions
        stage_factory = VocabParallel(barriers, g.pp_group, g.tp_group, tuple(g.pipeline_ranks()),
                                      plan.sequence_parallel, grads)
    sync = grads.param_sync

    def schedule(forward_only: bool) -> list[Action]:
        actions = build_schedule(plan.schedule, p, layout.v, plan.m, g.pp_rank, forward_only,
                                 vocab_barriers=barriers, overlap=plan.overlap_moe_expert_parallel_comm)
        return actions if sync is None else add_param_sync(actions, sync.reshard_after_forward)

    training = schedule(False)
    delayed = plan.delay_wgrad_compute and has_pairs(training)  # pairs defer weight grads past an exchange
    if not delayed and not any(a.op == "W" for a in training):  # no W pass: nothing to defer, torch's ops
        compute_at_once(q for chunk in chunks for q in chunk.parameters())

    grad_syncs = [GradSync("dp_grad_all_reduce", grads.finish_grad_sync)]  # all-reduce, or reduce-scatter
    if tied_embedding_weights(chunks, p):
        grad_syncs.append(GradSync("embedding_grad_sync",
                                   functools.partial(sync_embedding_grads, chunks, p, g.embedding_group)))
    partial = [q for chunk in chunks for q in chunk.parameters() if placements.partial_over(q, "tp")]
    if partial and plan.t > 1:  # sequence-parallel norms and router, per-head q/k norms
        grad_syncs.append(GradSync("tp_partial_grad_all_reduce",
                                   functools.partial(all_reduce_tp_partial_grads, partial, g.tp_group,
                                                     placements)))
    handlers = merge_handlers(overlap_handlers(), sync.handlers() if sync is not None else {})
    return Assembly(list(chunks), layout, functools.partial(stage_loss, tp_group=g.tp_group),
                    stage_factory, schedule, LossReduction(g.pp_group, g.dp_cp_group), grads,
                    handlers, grad_syncs, step_hooks(plan, chunks), has_pairs(training), plan.delay_wgrad_compute)


def step_hooks(plan: ParallelPlan, chunks: Sequence[nn.Module]) -> list[StepHook]:
    """The model's step hooks. The groups of ranks that saw other tokens of the global batch (one process
    sees them all): the data- and context-parallel ranks, and the tensor-parallel ones under sequence
    parallelism (each holds s/t tokens between the layers, and routes them); with the pipeline, the groups
    over which per-layer statistics and losses add up."""
    g = plan.groups
    tokens = [g.dp_cp_group, *([g.tp_group] if plan.sequence_parallel else [])]
    hooks: list[StepHook] = []
    if plan.moe.num_experts:  # router statistics summed like the loss; DeepSeek-V3's expert biases
        rows = moe_layer_names(plan.model, plan.moe)
        hooks.append(MoEStepHook(chunks, plan.moe.num_experts, rows, [g.pp_group, *tokens], tokens, g.device))
    if plan.model.mtp_num_layers:  # the MTP modules' losses, summed like the LM loss
        hooks.append(MTPStepHook(chunks, plan.model.mtp_num_layers, [g.pp_group, g.dp_cp_group], g.device))
    return hooks


def build_p2p(plan: ParallelPlan) -> P2PComm | None:
    """Point-to-point transport between pipeline stages of boundary tensors ``[b, s/c, h]`` (``[b, s/(c·t), h]``
    under sequence parallelism); None when p = 1.

    With ``plan.scatter_gather`` the scatter/gather optimisation (paper §4.1) sends only this TP rank's 1/t
    slice of the hidden dimension (every TP rank holds the same full tensor) and all-gathers it inside the
    receiving stage's TP group, cutting inter-node traffic t-fold (under sequence parallelism the boundary
    is already split: the plan turns it off).
    """
    if plan.p == 1:
        return None
    g, t = plan.groups, plan.t
    shape = (plan.micro_batch_size, plan.local_seq_length, plan.model.hidden_size)
    # The split is of the flat tensor (Megatron's split_tensor_into_1d_equal_chunks): a contiguous view
    # to send and one flat all-gather on arrival, no transposing copies (b·s·h is divisible by t, as h is).
    numel = shape[0] * shape[1] * shape[2]
    # The first batch_isend_irecv on a group must involve all its ranks under NCCL (torch's docs): one
    # collective over the pipeline group first, so the schedule's first batched call meets a ready group.
    communication.all_reduce(torch.zeros(1, device=g.device), group=g.pp_group, action="pipeline_warm_up")
    groups = direction_groups(g.dims, g.rank)  # one communicator per direction
    for group in groups.values():
        communication.all_reduce(torch.zeros(1, device=g.device), group=group, action="pipeline_warm_up")
    scatter_gather = plan.scatter_gather
    return P2PComm(groups=groups,
        pp_ranks=g.pipeline_ranks(), shape=shape, device=g.device, group=g.pp_group, dtype=plan.dtype,
        pack=(lambda x: split(x.reshape(-1), g.tp_group, 0)) if scatter_gather else None,
        unpack=(lambda x: all_gather(x, g.tp_group, 0).view(shape)) if scatter_gather else None,
        packed_shape=(numel // t,) if scatter_gather else None,
    )
