"""What a MoE model adds to every training step, as a step hook (``ptdp.parallel.assembly.StepHook``).

* Before the schedule: the auxiliary losses' backward weight, the same per-microbatch factor as the LM
  loss (1/m times the fp16 loss scale), so their gradients are those of the mean objective.
* After the step: the statistics each ``MoELayer`` accumulated as detached device tensors over its
  training forwards (``ptdp.models.moe``: the auxiliary losses, the load per expert, the dropped
  assignments), gathered into one ``[MoE layers, 3 + E]`` tensor by GLOBAL layer (rows of layers on other
  pipeline stages are zero here) and summed over the pipeline and the data/context-parallel groups -- the
  same reductions as the loss -- and the tensor-parallel group under sequence parallelism, whose ranks
  route different tokens. No host sync: ``ptdp.train.moe_metrics`` reads the record's ``moe_stats``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ptdp.models.moe import moe_layer_pattern, pop_moe_stats, set_aux_loss_scale
from ptdp.observability import flight_recorder
from ptdp.parallel.collectives import group_size

_LOSSES = ("load_balancing_loss", "z_loss")


class MoEStepHook:
    """The MoE step hook of ``chunks`` (the rank's model chunks) with ``num_experts`` experts in the layers
    ``moe_layer_freq`` makes sparse of ``num_layers``; ``groups``: where the statistics are summed, in order
    (every rank calls the same collectives)."""

    def __init__(self, chunks: Sequence[nn.Module], num_experts: int, moe_layer_freq, num_layers: int,
                 groups: Sequence, device: torch.device) -> None:
        self.chunks, self.num_experts, self.groups, self.device = list(chunks), num_experts, list(groups), device
        self.rows = [i for i, sparse in enumerate(moe_layer_pattern(moe_layer_freq, num_layers)) if sparse]

    def before_schedule(self, microbatch_loss_scale: float) -> None:
        set_aux_loss_scale(self.chunks, microbatch_loss_scale)

    def after_step(self) -> dict[str, torch.Tensor]:
        """``{"moe_stats": [MoE layers, 3 + E]}``, summed over every rank that saw other tokens or layers."""
        out = torch.zeros(len(self.rows), 3 + self.num_experts, dtype=torch.float32, device=self.device)
        for name, stats in pop_moe_stats(self.chunks).items():
            row = self.rows.index(int(name.split(".")[1]))  # "layers.<global index>.mlp"
            out[row, 0] = stats.get(_LOSSES[0], 0.0)
            out[row, 1] = stats.get(_LOSSES[1], 0.0)
            out[row, 2] = stats["dropped"]
            out[row, 3:] = stats["load"]
        for group in self.groups:
            if group_size(group) > 1:
                flight_recorder.record("all_reduce", group=group, tensor=out, action="moe_stats")
                dist.all_reduce(out, group=group)
        return {"moe_stats": out}
