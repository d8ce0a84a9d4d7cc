"""What multi-token prediction (``ptdp.models.mtp``) adds to every training step: a step hook
(``ptdp.parallel.assembly.StepHook``).

* Before the schedule: the MTP loss's backward weight, the LM loss's per-microbatch factor (1/m times the
  fp16 loss scale), as for MoE's auxiliary losses.
* After the step: each module's cross-entropy, summed over the microbatches by the module (on the last
  pipeline stage) or by the vocabulary passes (``ptdp.parallel.vocab``: every pipeline rank holds a share),
  summed over ``groups`` (the assembly's: the pipeline and the data/context-parallel replicas, as the LM
  loss) into the record's ``mtp_stats`` (``[D]``, a device tensor: no host sync). ``ptdp.train.moe_metrics``
  turns it into ``mtp_loss``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ptdp.models.layers import set_aux_loss_scale
from ptdp.models.mtp import pop_mtp_losses
from ptdp.parallel.collectives import all_reduce


class MTPStepHook:
    """The MTP step hook of ``chunks`` (the rank's model chunks) with ``num_layers`` modules; ``groups``:
    where the losses are summed, in order (every rank calls the same collectives)."""

    def __init__(self, chunks: Sequence[nn.Module], num_layers: int, groups: Sequence, device: torch.device) -> None:
        self.chunks, self.num_layers, self.groups, self.device = list(chunks), num_layers, list(groups), device

    def before_schedule(self, microbatch_loss_scale: float) -> None:
        set_aux_loss_scale(self.chunks, microbatch_loss_scale)

    def after_step(self) -> dict[str, torch.Tensor]:
        """``{"mtp_stats": [D]}``: each module's cross-entropy summed over the microbatches and the ranks."""
        losses = pop_mtp_losses(self.chunks)
        out = torch.zeros(self.num_layers, dtype=torch.float32, device=self.device) if losses is None \
            else losses.to(torch.float32)
        for group in self.groups:
            all_reduce(out, group)
        return {"mtp_stats": out}
