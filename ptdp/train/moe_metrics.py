"""Mixture-of-experts metrics per iteration (issue 25): the auxiliary losses, the busiest expert's load over
the mean, the dropped tokens -- in the progress line, ``--metrics-file`` and TensorBoard; and (issue 41) the
multi-token prediction loss and the expert-bias update after each step.

Each ``MoELayer`` accumulates detached device tensors over its training forwards (``ptdp.models.moe``);
after the step they are gathered into one ``[MoE layers, 3 + E]`` tensor by GLOBAL layer (rows of layers on
other pipeline stages are zero here) and summed over the pipeline and the data/context-parallel groups, the
same reductions as the loss (and the tensor-parallel group under sequence parallelism, whose ranks route
different tokens), without a host sync. ``read_records`` turns it into the record's numbers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ptdp.models.layers import set_aux_loss_scale
from ptdp.models.moe import moe_layer_names, pop_moe_stats
from ptdp.models.moe import update_expert_biases as update_biases
from ptdp.models.mtp import pop_mtp_losses
from ptdp.observability import flight_recorder
from ptdp.parallel.collectives import group_size
from ptdp.train.state import TrainState

_LOSSES = ("load_balancing_loss", "z_loss")
KEYS = ("moe_aux_loss", "moe_z_loss", "moe_max_load_ratio", "moe_dropped_tokens", "mtp_loss")  # record keys


def set_loss_scale(trainer: TrainState, scale: float) -> None:
    """The auxiliary losses' backward weight (MoE, multi-token prediction): the same 1/m (times the fp16 loss
    scale) as the LM loss."""
    set_aux_loss_scale(trainer.chunks, scale)


def update_expert_biases(trainer: TrainState) -> None:
    """Issue 41: after the optimizer step, each router's expert bias moves by the token counts of the step,
    summed over the tensor-, data- and context-parallel ranks (as Megatron-Core does; the ranks of one layer
    that routed other tokens are among them, expert-parallel ones included: under folding they are these
    ranks). Ranks that routed the same tokens add them t times over, which the sign of (mean - load) ignores."""
    state = trainer.state

    def reduce(counts: torch.Tensor) -> torch.Tensor:
        for group in (state.tp_group, state.dp_cp_group):  # every rank, in order
            if group_size(group) > 1:
                flight_recorder.record("all_reduce", group=group, tensor=counts, action="expert_bias_counts")
                dist.all_reduce(counts, group=group)
        return counts

    update_biases(trainer.chunks, reduce)


def gather_mtp_losses(trainer: TrainState) -> torch.Tensor | None:
    """Issue 41: the ``[D]`` multi-token prediction cross-entropies of this iteration, summed over the
    microbatches, the pipeline (the last stage holds them) and the data/context-parallel replicas."""
    m, state = trainer.config.model, trainer.state
    if not m.mtp_num_layers:
        return None
    losses = pop_mtp_losses(trainer.chunks)
    out = torch.zeros(m.mtp_num_layers, dtype=torch.float32, device=state.device) if losses is None \
        else losses.to(torch.float32)
    for group in (state.pp_group, state.dp_cp_group):  # every rank, in order
        if group_size(group) > 1:
            flight_recorder.record("all_reduce", group=group, tensor=out, action="mtp_losses")
            dist.all_reduce(out, group=group)
    return out


def mtp_metrics(losses: torch.Tensor, trainer: TrainState) -> dict:
    """``mtp_loss``: the mean over the D modules of their cross-entropy, averaged like the LM loss (the
    objective adds ``--mtp-loss-scaling-factor`` times it)."""
    replicas = trainer.num_microbatches * trainer.state.dims.dp * trainer.state.dims.cp
    return {"mtp_loss": float(losses.to(torch.float64).mean()) / replicas}


def gather_moe_stats(trainer: TrainState) -> torch.Tensor | None:
    """This iteration's per-layer statistics, summed over every rank that saw other tokens or layers."""
    moe, m, state = trainer.config.moe, trainer.config.model, trainer.state
    if not moe.num_experts:
        return None
    rows = moe_layer_names(m, moe)  # by logical name: "layers.<global index>.mlp", then the MTP modules'
    out = torch.zeros(len(rows), 3 + moe.num_experts, dtype=torch.float32, device=state.device)
    for name, stats in pop_moe_stats(trainer.chunks).items():
        row = rows.index(name)
        out[row, 0] = stats.get(_LOSSES[0], 0.0)
        out[row, 1] = stats.get(_LOSSES[1], 0.0)
        out[row, 2] = stats["dropped"]
        out[row, 3:] = stats["load"]
    # under sequence parallelism each TP rank routed its own s/t tokens: their statistics add up too
    sp = trainer.config.parallel.sequence_parallel and state.dims.tp > 1
    for group in (state.pp_group, state.dp_cp_group, *([state.tp_group] if sp else [])):  # every rank, in order
        if group_size(group) > 1:
            flight_recorder.record("all_reduce", group=group, tensor=out, action="moe_stats")
            dist.all_reduce(out, group=group)
    return out


def moe_metrics(stats: torch.Tensor, trainer: TrainState) -> dict:
    """The record's MoE numbers: each auxiliary loss summed over layers (each layer's mean over the
    micro-batches: what the objective adds), max over layers of the busiest expert's load / the mean load,
    and the routed (token, expert) assignments dropped over the global batch."""
    replicas = trainer.num_microbatches * trainer.state.dims.dp * trainer.state.dims.cp
    values = stats.to(torch.float64).cpu()
    load = values[:, 3:]
    ratio = (load.max(1).values / load.mean(1).clamp_min(1e-12)).max() if len(load) else torch.tensor(0.0)
    return {"moe_aux_loss": float(values[:, 0].sum()) / replicas, "moe_z_loss": float(values[:, 1].sum()) / replicas,
            "moe_max_load_ratio": float(ratio), "moe_dropped_tokens": int(values[:, 2].sum())}


def progress_suffix(record: dict) -> str:
    """`` | mtp loss: ...`` with multi-token prediction, `` | moe aux loss: ... | max expert load/mean: ... |
    dropped tokens: ...`` when the model has experts."""
    mtp = f" | mtp loss: {record['mtp_loss']:.6E}" if "mtp_loss" in record else ""
    if "moe_aux_loss" not in record:
        return mtp
    return (f"{mtp} | moe aux loss: {record['moe_aux_loss']:.4E} | moe z loss: {record['moe_z_loss']:.4E} | "
            f"max expert load/mean: {record['moe_max_load_ratio']:.2f} | dropped tokens: "
            f"{record['moe_dropped_tokens']}")
