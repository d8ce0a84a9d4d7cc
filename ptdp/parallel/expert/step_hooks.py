"""What a MoE model adds to every training step, as a step hook (``ptdp.parallel.assembly.StepHook``).

* Before the schedule: the auxiliary losses' backward weight, the same per-microbatch factor as the LM
  loss (1/m times the fp16 loss scale), so their gradients are those of the mean objective.
* After the step: the statistics each ``MoELayer`` accumulated as detached device tensors over its
  training forwards (``ptdp.models.moe``: the auxiliary losses, the load per expert, the dropped
  assignments), gathered into one ``[MoE layers, 3 + E]`` tensor by logical layer name (rows of layers on
  other pipeline stages are zero here) and summed over ``stats_groups`` (the assembly's: the pipeline and
  the ranks that routed other tokens), without a host sync: ``ptdp.train.moe_metrics`` reads the record's
  ``moe_stats``.
* After the step, auxiliary-loss-free balancing: every router with an expert bias moves it by
  the step's token counts (``ptdp.models.moe.update_expert_biases``), summed over ``token_groups``: the
  ranks whose routers saw other tokens of the same global batch -- data- and context-parallel ranks, and
  tensor-parallel ranks under sequence parallelism. Expert-parallel ranks are among them (MoE Parallel
  Folding draws the expert group from the same pipeline stage's t·c·d ranks), and pipeline ranks hold
  other layers, so the sums are exactly one process's counts and every layout moves the biases alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ptdp.models.moe import pop_moe_stats, set_aux_loss_scale, update_expert_biases
from ptdp.parallel.collectives import all_reduce

_LOSSES = ("load_balancing_loss", "z_loss")


def all_reduce_over(tensor: torch.Tensor, groups: Sequence) -> torch.Tensor:
    """``tensor`` summed in place over each of ``groups`` in turn (every rank calls the same collectives)."""
    for group in groups:
        all_reduce(tensor, group)
    return tensor


class MoEStepHook:
    """The MoE step hook of ``chunks`` (the rank's model chunks) with ``num_experts`` experts; ``rows``: the
    whole model's MoE layers by logical name (``ptdp.models.moe.moe_layer_names``); ``stats_groups`` and
    ``token_groups``: where the statistics and the expert-bias token counts are summed, in order."""

    def __init__(self, chunks: Sequence[nn.Module], num_experts: int, rows: Sequence[str], stats_groups: Sequence,
                 token_groups: Sequence, device: torch.device) -> None:
        self.chunks, self.num_experts, self.rows, self.device = list(chunks), num_experts, list(rows), device
        self.stats_groups, self.token_groups = list(stats_groups), list(token_groups)

    def before_schedule(self, microbatch_loss_scale: float) -> None:
        set_aux_loss_scale(self.chunks, microbatch_loss_scale)

    def after_step(self) -> dict[str, torch.Tensor]:
        """``{"moe_stats": [MoE layers, 3 + E]}``, summed over every rank that saw other tokens or layers;
        the expert biases moved."""
        update_expert_biases(self.chunks, lambda counts: all_reduce_over(counts, self.token_groups))
        out = torch.zeros(len(self.rows), 3 + self.num_experts, dtype=torch.float32, device=self.device)
        for name, stats in pop_moe_stats(self.chunks).items():
            row = self.rows.index(name)
            out[row, 0] = stats.get(_LOSSES[0], 0.0)
            out[row, 1] = stats.get(_LOSSES[1], 0.0)
            out[row, 2] = stats["dropped"]
            out[row, 3:] = stats["load"]
        return {"moe_stats": all_reduce_over(out, self.stats_groups)}
