"""What one rank trains with, as one typed object, and how it is set up.

``setup(config)``: process groups → seeds → data → model chunks (``ptdp.parallel.parallelize``) → gradient buffers
and optimizer → what the step runs (``ptdp.parallel.assembly``: the action list, handlers, stage factory, gradient
syncs, step hooks) → point-to-point transport. Everything the step, the
loop, evaluation and checkpointing read is a field of :class:`TrainState`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ptdp.checkpointing.storage import latest_info
from ptdp.config import Config
from ptdp.data import DataSplits
from ptdp.data.documents import DocumentOptions
from ptdp.data.training_data import datasets_for_config
from ptdp.models import GPTModel
from ptdp.observability.timeline import Timeline
from ptdp.ops.document_attention import select_document_attention
from ptdp.optim import MegatronOptimizer, setup_optimizer
from ptdp.parallel import ParallelDims, ParallelState, init_distributed
from ptdp.parallel.assembly import Assembly, assemble
from ptdp.parallel.collectives import all_gather, split
from ptdp.parallel.context.documents import context_parallel_document_line
from ptdp.parallel.data.protocol import GradReducer
from ptdp.parallel.expert.dims import build_expert_parallel
from ptdp.parallel.init import params_dtype
from ptdp.parallel.parallelize import build_model_chunks, local_seq_length
from ptdp.parallel.pipeline.p2p import P2PComm, direction_groups
from ptdp.parallel.pipeline.stage import tied_embedding_weights
from ptdp.parallel.placement import Placements
from ptdp.parallel.tensor import model_parallel_seed
from ptdp.runtime.phases import phase
from ptdp.schedule.actions import Action
from ptdp.schedule.registry import schedule_placement
from ptdp.train.batches import BatchFormat


@dataclass
class TrainState:
    """Everything one rank holds: its process groups, model chunks, data, gradients and optimizer."""

    config: Config
    state: ParallelState  # this rank's process groups and coordinates
    chunks: list[GPTModel]  # this rank's model chunks, in the order of its virtual stages
    placements: Placements  # where each of their parameters lives in the full model (ptdp.parallel.placement)
    data: DataSplits
    grads: GradReducer  # the data-parallel gradient synchronisation (ptdp.parallel.data)
    optimizer: MegatronOptimizer
    num_microbatches: int
    schedule: list[Action]  # this rank's action list for one iteration
    comm: P2PComm | None  # None when p = 1
    assembly: Assembly  # what each parallelism adds to the step and evaluation
    batch_format: BatchFormat  # how each global batch is cut, and what its microbatches carry (documents)
    metrics: list[dict] = field(default_factory=list)
    timeline: Timeline | None = None  # --timeline: this rank's Chrome-trace recorder
    peak_activation_bytes: int | None = None  # measured in the first iteration of the run

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for chunk in self.chunks for p in chunk.parameters()]

    @property
    def vocab_size(self) -> int:
        return self.chunks[0].vocab_size


def setup(config: Config) -> TrainState:
    par, tr = config.parallel, config.training
    rank, world_size, device = init_distributed(par.distributed_timeout_minutes)
    dims = ParallelDims(world_size, par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                        par.context_parallel_size)
    state = ParallelState(dims, rank, device, schedule_placement(par.schedule))
    if config.moe.num_experts:  # issue 25: the MoE layers' own etp x e x edp layout over the same ranks
        state.expert = build_expert_parallel(state, par.expert_model_parallel_size, par.expert_tensor_parallel_size,
                                             par.sequence_parallel)
    model_parallel_seed(tr.seed, state.tp_rank, state.pp_rank, device)
    # Megatron's sample order, sized by train_iters, going on from --load's data state (ptdp/data/training_data.py)
    data = datasets_for_config(config, *latest_info(config.checkpoint.load))
    vocab_size = config.model.vocab_size or data.tokenizer.vocab_size
    padded = config.model.padded_vocab_size(vocab_size, dims.tp * (dims.pp if par.enable_vocab_parallel else 1))
    with phase("building the model"):  # rank 0 says so when it takes more than 2 s
        model = build_model_chunks(config, state, vocab_size, padded)
    grads, optimizer = setup_optimizer(model, config, state, tied_embedding_weights(model.chunks, dims.pp))
    m = config.num_microbatches(world_size)
    assembly = assemble(config, state, model.chunks, grads, m, model.placements)
    return TrainState(config, state, model.chunks, model.placements, data, grads, optimizer, m, assembly.actions(),
                      build_p2p(config, state), assembly, batch_format(config, state, data.tokenizer.eod_id))


def batch_format(config: Config, state: ParallelState, eod: int) -> BatchFormat:
    """The trainer's :class:`BatchFormat`; with ``--reset-attention-mask`` the attention kernel is chosen
    here, once, and rank 0 prints the one line saying which (``ptdp.ops.document_attention``)."""
    d, tr = config.data, config.training
    options = DocumentOptions(eod, d.reset_position_ids, d.reset_attention_mask, d.eod_mask_loss)
    kernel = None
    if options.reset_attention_mask:
        kernel, line = select_document_attention(state.device, params_dtype(config), config.model.attention_dropout)
        if state.dims.cp > 1:
            line += context_parallel_document_line(config.parallel.cp_comm_type)
        if state.rank == 0:
            print(f" {line}", flush=True)
    return BatchFormat(tr.global_batch_size, tr.micro_batch_size, options if options.any else None, kernel,
                       tr.calculate_per_token_loss)


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
