"""Mixture-of-experts metrics per iteration: the auxiliary losses, the busiest expert's load over
the mean, the dropped tokens -- and the multi-token prediction loss -- in the progress line,
``--metrics-file`` and TensorBoard.

The model's step hooks (``ptdp.parallel.expert.step_hooks``) leave device tensors summed over the ranks in
the step's record: ``moe_stats`` (``[MoE layers, 3 + E]``) and ``mtp_stats`` (``[D]``, each MTP module's
cross-entropy summed over the microbatches); ``read_records`` turns them into the record's numbers here.
"""

from __future__ import annotations

import torch

from ptdp.train.state import TrainState


def moe_metrics(stats: torch.Tensor, trainer: TrainState) -> dict:
    """The record's MoE numbers: each auxiliary loss summed over layers (each layer's mean over the
    micro-batches: what the objective adds), max over layers of the busiest expert's load / the mean load,
    and the routed (token, expert) assignments dropped over the global batch."""
    replicas = trainer.plan.m * trainer.plan.d * trainer.plan.c
    values = stats.to(torch.float64).cpu()
    load = values[:, 3:]
    ratio = (load.max(1).values / load.mean(1).clamp_min(1e-12)).max() if len(load) else torch.tensor(0.0)
    return {"moe_aux_loss": float(values[:, 0].sum()) / replicas, "moe_z_loss": float(values[:, 1].sum()) / replicas,
            "moe_max_load_ratio": float(ratio), "moe_dropped_tokens": int(values[:, 2].sum())}


def mtp_metrics(losses: torch.Tensor, trainer: TrainState) -> dict:
    """``mtp_loss``: the mean over the D modules of their cross-entropy, averaged like the LM loss (the
    objective adds ``--mtp-loss-scaling-factor`` times it)."""
    replicas = trainer.plan.m * trainer.plan.d * trainer.plan.c
    return {"mtp_loss": float(losses.to(torch.float64).mean()) / replicas}


def progress_suffix(record: dict) -> str:
    """`` | mtp loss: ...`` with multi-token prediction, `` | moe aux loss: ... | max expert load/mean: ... |
    dropped tokens: ...`` when the model has experts."""
    mtp = f" | mtp loss: {record['mtp_loss']:.6E}" if "mtp_loss" in record else ""
    if "moe_aux_loss" not in record:
        return mtp
    return (f"{mtp} | moe aux loss: {record['moe_aux_loss']:.4E} | moe z loss: {record['moe_z_loss']:.4E} | "
            f"max expert load/mean: {record['moe_max_load_ratio']:.2f} | dropped tokens: "
            f"{record['moe_dropped_tokens']}")
