"""The gated activations of the MLPs and the experts: ``act(gate) * up`` over fc1's ``[gate; up]`` output.

SwiGLU (silu), GeGLU (tanh GeLU, Gemma) and quick-GeGLU (``g·sigmoid(1.702·g)``, GPT-OSS's experts), with
GPT-OSS's two changes as Megatron-Core spells them: ``--activation-func-clamp-value v`` clamps the gate to
``<= v`` and the linear half to ``[-v, v]`` first, ``--glu-linear-offset o`` multiplies by ``up + o``
instead of ``up``. One function for the dense MLP (``ptdp.models.gpt.MLP``) and the experts
(``ptdp.models.moe.GroupedExperts``), so both compute the same thing from the same flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from ptdp.config import ModelConfig

QUICK_GELU_ALPHA = 1.702  # the sigmoid approximation of GeLU (Hendrycks & Gimpel), GPT-OSS's alpha


@dataclass(frozen=True)
class GatedActivation:
    """``h [..., 2f]`` (this rank's gate columns, then its up columns) → ``[..., f]``."""

    kind: str  # "swiglu", "geglu" or "quick_geglu"
    offset: float = 0.0
    clamp: float | None = None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        if self.clamp is not None:
            gate, up = gate.clamp(max=self.clamp), up.clamp(-self.clamp, self.clamp)
        if self.kind == "swiglu":
            act = F.silu(gate)
        elif self.kind == "geglu":
            act = F.gelu(gate, approximate="tanh")
        else:
            act = gate * torch.sigmoid(QUICK_GELU_ALPHA * gate)
        return act * (up + self.offset) if self.offset else act * up


def gated_activation(cfg: ModelConfig) -> GatedActivation | None:
    """The gated activation ``cfg`` asks for, or None (the plain GeLU MLP)."""
    kind = "swiglu" if cfg.swiglu else "geglu" if cfg.geglu else "quick_geglu" if cfg.quick_geglu else None
    if kind is None:
        return None
    return GatedActivation(kind, cfg.glu_linear_offset, cfg.activation_func_clamp_value)
