"""Mixture-of-experts metrics per iteration (issue 25): the auxiliary losses, the busiest expert's load over
the mean, the dropped tokens -- in the progress line, ``--metrics-file`` and TensorBoard.

Each ``MoELayer`` accumulates detached device tensors over its training forwards (``ptdp.models.moe``);
after the step they are gathered into one ``[MoE layers, 3 + E]`` tensor by GLOBAL layer (rows of layers on
other pipeline stages are zero here) and summed over the pipeline and the data/context-parallel groups, the
same reductions as the loss (and the tensor-parallel group under sequence parallelism, whose ranks route
different tokens), without a host sync. ``read_records`` turns it into the record's numbers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ptdp.models.moe import moe_layer_pattern, pop_moe_stats, set_aux_loss_scale
from ptdp.observability import flight_recorder
from ptdp.parallel.collectives import group_size
from ptdp.train.state import TrainState

_LOSSES = ("load_balancing_loss", "z_loss")
KEYS = ("moe_aux_loss", "moe_z_loss", "moe_max_load_ratio", "moe_dropped_tokens")  # record keys


def set_loss_scale(trainer: TrainState, scale: float) -> None:
    """The auxiliary losses' backward weight: the same 1/m (times the fp16 loss scale) as the LM loss."""
    if trainer.config.moe.num_experts:
        set_aux_loss_scale(trainer.chunks, scale)


def gather_moe_stats(trainer: TrainState) -> torch.Tensor | None:
    """This iteration's per-layer statistics, summed over every rank that saw other tokens or layers."""
    moe, m, state = trainer.config.moe, trainer.config.model, trainer.state
    if not moe.num_experts:
        return None
    rows = [i for i, sparse in enumerate(moe_layer_pattern(moe.moe_layer_freq, m.num_layers)) if sparse]
    out = torch.zeros(len(rows), 3 + moe.num_experts, dtype=torch.float32, device=state.device)
    for name, stats in pop_moe_stats(trainer.chunks).items():
        row = rows.index(int(name.split(".")[1]))  # "layers.<global index>.mlp"
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
    """`` | moe aux loss: ... | max expert load/mean: ... | dropped tokens: ...`` when the model has experts."""
    if "moe_aux_loss" not in record:
        return ""
    return (f" | moe aux loss: {record['moe_aux_loss']:.4E} | moe z loss: {record['moe_z_loss']:.4E} | "
            f"max expert load/mean: {record['moe_max_load_ratio']:.2f} | dropped tokens: "
            f"{record['moe_dropped_tokens']}")
