"""What one rank trains with, as one typed object, and how it is set up.

``setup(config)``: process groups → the plan (``ptdp.parallel.plan``: every size and decision, resolved once)
→ seeds → data → model chunks (``ptdp.parallel.parallelize``) → the data-parallel gradients
(``ptdp.parallel.gradients``) → the optimizer over their shards → what the step
runs (``ptdp.parallel.assembly``: the action list, handlers, stage factory, gradient syncs, step hooks) →
point-to-point transport. Each of those takes the plan, not the configuration. Everything the step, the
loop, evaluation and checkpointing read is a field of :class:`TrainState`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from torch import nn

from ptdp.checkpointing.storage import latest_info
from ptdp.config import Config
from ptdp.data import DataSplits
from ptdp.data.documents import DocumentOptions
from ptdp.data.train_stream import TrainStream
from ptdp.data.training_data import datasets_for_config, model_vocab_size
from ptdp.models import GPTModel
from ptdp.models.layers import use_window_kernel
from ptdp.observability.timeline import Timeline
from ptdp.ops.document_attention import select_document_attention
from ptdp.ops.flex_window import select_window_attention
from ptdp.optim import MegatronOptimizer, setup_optimizer
from ptdp.optim.memory import HeldStates
from ptdp.parallel import init_distributed
from ptdp.parallel.assembly import Assembly, assemble, build_p2p
from ptdp.parallel.context.documents import context_parallel_document_line
from ptdp.parallel.data.protocol import GradReducer
from ptdp.parallel.gradients import build_gradients
from ptdp.parallel.parallelize import build_model_chunks
from ptdp.parallel.pipeline.p2p import P2PComm
from ptdp.parallel.pipeline.stage import tied_embedding_weights
from ptdp.parallel.placement import Placements
from ptdp.parallel.plan import ParallelPlan, process_groups, resolve_plan
from ptdp.parallel.tensor import model_parallel_seed
from ptdp.runtime.phases import phase
from ptdp.schedule.actions import Action
from ptdp.train.batches import BatchFormat


@dataclass
class TrainState:
    """Everything one rank holds: its plan (with its process groups), model chunks, data, gradients and optimizer."""

    config: Config  # the run's configuration (derived): what is recorded in checkpoints, the loop's options
    plan: ParallelPlan  # every size and decision of the parallel run, and this rank's groups (plan.groups)
    chunks: list[GPTModel]  # this rank's model chunks, in the order of its virtual stages
    placements: Placements  # where each of their parameters lives in the full model (ptdp.parallel.placement)
    data: DataSplits
    grads: GradReducer  # the data-parallel gradients (ptdp.parallel.gradients): the assembly drives them
    optimizer: MegatronOptimizer
    schedule: list[Action]  # this rank's action list for one iteration
    comm: P2PComm | None  # None when p = 1
    assembly: Assembly  # what each parallelism adds to the step and evaluation
    batch_format: BatchFormat  # how each global batch is cut, and what its microbatches carry (documents)
    metrics: list[dict] = field(default_factory=list)
    timeline: Timeline | None = None  # --timeline: this rank's Chrome-trace recorder
    peak_activation_bytes: int | None = None  # measured in the first iteration of the run
    held_states: HeldStates = field(default_factory=HeldStates)  # the memory report's model-state bytes

    @functools.cached_property
    def params(self) -> list[nn.Parameter]:
        """The chunks' parameters: the same objects for the whole run once set up (ZeRO-3 frees and gathers
        their storages, never swaps them), so listed once."""
        return [p for chunk in self.chunks for p in chunk.parameters()]

    @property
    def vocab_size(self) -> int:
        return self.chunks[0].vocab_size

    # ptdp.checkpointing.Checkpointable: what a checkpoint saves and loads of this state
    @property
    def model_sharded(self) -> bool:
        """ZeRO-3: the model's weights too are only this rank's pieces (``ShardPiece.model_view``)."""
        return self.grads.param_sync is not None

    @property
    def data_position(self) -> TrainStream:
        return self.data.train


def setup(config: Config) -> TrainState:
    """This rank's :class:`TrainState` for a validated, derived ``config`` (``ptdp.config.derive``)."""
    with phase("joining the other processes: rendezvous and process groups"):  # rank 0 says so after 2 s
        rank, world_size, device = init_distributed(config.parallel.distributed_timeout_minutes)
        groups = process_groups(config, rank, world_size, device)
    plan = resolve_plan(config, groups)
    model_parallel_seed(plan.seed, groups.tp_rank, groups.pp_rank, device)
    with phase("reading the data: tokenizer, indexes and sample order"):
        # Megatron's sample order, sized by train_iters, going on from --load's data state (ptdp/data/training_data.py)
        data = datasets_for_config(config, *latest_info(config.checkpoint.load))
    vocab_size = model_vocab_size(config) if config.model.vocab_size else data.tokenizer.vocab_size
    padded = config.model.padded_vocab_size(vocab_size, plan.vocab_divisor)
    with phase("building the model"):  # rank 0 says so when it takes more than 2 s
        model = build_model_chunks(plan, vocab_size, padded)
        window_kernel(config, plan, model.chunks)
    with phase("setting up the gradient buffers, the optimizer and the pipeline"):
        gradients = build_gradients(model, plan, tied_embedding_weights(model.chunks, plan.p))
        grads = gradients.reducer
        optimizer = setup_optimizer(model, plan, gradients, config.optimizer, config.precision)
        assembly = assemble(plan, model.chunks, grads, model.placements)
        comm = build_p2p(plan)
    return TrainState(config, plan, model.chunks, model.placements, data, grads, optimizer, assembly.actions(),
                      comm, assembly, batch_format(config, plan, data.tokenizer.eod_id))


def window_kernel(config: Config, plan: ParallelPlan, chunks: list[nn.Module]) -> None:
    """A model with sliding windows, sinks or capped scores: the kernel of that attention, chosen here, once
    (``ptdp.ops.flex_window``), and rank 0's one line saying which."""
    m = config.model
    if not (m.window_size or m.softmax_type != "vanilla" or m.attn_logit_softcapping):
        return
    kernel, line = select_window_attention(plan.groups.device, plan.dtype, m.attention_dropout, m.head_dim)
    use_window_kernel(chunks, kernel)
    if plan.groups.rank == 0:
        print(f" {line}", flush=True)


def batch_format(config: Config, plan: ParallelPlan, eod: int) -> BatchFormat:
    """The trainer's :class:`BatchFormat`; with ``--reset-attention-mask`` the attention kernel is chosen
    here, once, and rank 0 prints the one line saying which (``ptdp.ops.document_attention``)."""
    d, tr = config.data, config.training
    # --sft packs whole conversations: positions and attention restart at each one (ptdp/data/sft_dataset.py)
    options = DocumentOptions(eod, d.reset_position_ids or d.sft, d.reset_attention_mask or d.sft, d.eod_mask_loss,
                              d.sft)
    kernel = None
    if options.reset_attention_mask:
        kernel, line = select_document_attention(plan.groups.device, plan.dtype, config.model.attention_dropout)
        if plan.c > 1:
            line += context_parallel_document_line(plan.cp_comm_type)
        if plan.groups.rank == 0:
            print(f" {line}", flush=True)
    # --fault-tolerant-replicas R: a group's batches are shares of B/R samples (ptdp.train.replicas)
    shares = max(config.parallel.fault_tolerant_replicas, 1)
    return BatchFormat(tr.global_batch_size // shares, tr.micro_batch_size, options if options.any else None, kernel,
                       tr.calculate_per_token_loss)

