"""``--optimizer``: the step functions of the update rules, each building the torch optimizer that steps a
rank's tensors.

The step (``MegatronOptimizer.step``: unscale, norm, clip, ``optimizer.step()``, publish) and the checkpoint
code know none of them: an entry of :data:`OPTIMIZERS` takes the tensors this rank steps (:class:`Stepped`:
whole fp32 parameters, or the fp32 main pieces of this rank's shards) and returns a torch optimizer over them;
:func:`state_fields` and :func:`install_state` are what the checkpoints read and write per parameter.
What each rule keeps and reads is declared in the torch-free table ``ptdp.config.optimizers`` (its
``OptimizerSpec``, which the flags and the planner read too); this module only adds the torch side.

* ``adam``: torch's AdamW with Megatron's decay groups (weight matrices only) -- the reference;
* ``sgd``: torch's SGD with ``--sgd-momentum`` and L2 weight decay on the same groups (Megatron-LM's SGD);
* ``muon``: Muon on the hidden matrices (``ptdp.optim.muon``), AdamW on the rest, as one :class:`Chained`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ptdp.config import OptimizerConfig
from ptdp.config.optimizers import STATE_FIELD_BYTES, optimizer_spec
from ptdp.optim import eager
from ptdp.optim.muon import MuonLayout, muon, placement_of
from ptdp.optim.muon_units import is_hidden_matrix
from ptdp.optim.offload import HostOffloadAdamW, HostOffloadSGD, fused_adamw_on
from ptdp.parallel.placement import Placements


@dataclass(frozen=True)
class Stepped:
    """A tensor an optimizer steps (its ``.grad`` set before each step), the model parameter it is (a piece
    of), and where it starts in that parameter's ``view(-1)``."""

    tensor: torch.Tensor
    param: nn.Parameter
    start: int = 0


class Chained:
    """Several torch optimizers over disjoint tensors, stepped in order, seen as one (Megatron's
    ``ChainedOptimizer``): ``param_groups`` all of theirs (the learning rate reaches every one), ``state``
    their union, :meth:`member` the one that steps a tensor."""

    def __init__(self, members: list[torch.optim.Optimizer]):
        self.members = members
        self._member = {t: m for m in members for group in m.param_groups for t in group["params"]}

    @property
    def param_groups(self) -> list[dict]:
        return [group for m in self.members for group in m.param_groups]

    @property
    def state(self) -> dict:
        return {t: s for m in self.members for t, s in m.state.items()}

    def member(self, tensor: torch.Tensor) -> torch.optim.Optimizer:
        return self._member[tensor]

    def step(self) -> None:
        for m in self.members:
            m.step()


Inner = torch.optim.Optimizer | Chained


def member_of(optimizer: Inner, tensor: torch.Tensor) -> torch.optim.Optimizer:
    """The torch optimizer of ``optimizer`` (a :class:`Chained` or one torch optimizer) that steps ``tensor``."""
    return optimizer.member(tensor) if isinstance(optimizer, Chained) else optimizer


def _decay_groups(stepped: list[Stepped], placements: Placements, weight_decay: float) -> list[dict]:
    return [{"params": [s.tensor for s in stepped if placements.decays(s.param)], "weight_decay": weight_decay},
            {"params": [s.tensor for s in stepped if not placements.decays(s.param)], "weight_decay": 0.0}]


def adamw(stepped: list[Stepped], cfg: OptimizerConfig, placements: Placements) -> torch.optim.AdamW:
    """torch's AdamW with Megatron's decay groups, its fused implementation (one kernel for all tensors) where
    torch has one for the device -- CUDA, and the CPU since torch 2.4, where it steps a small model 4x faster
    than the default for-each one -- the host's with ``--optimizer-cpu-offload``."""
    groups = _decay_groups(stepped, placements, cfg.weight_decay)
    kwargs = {"lr": cfg.lr, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_eps}
    if cfg.optimizer_cpu_offload:  # state and step on the host
        return HostOffloadAdamW(groups, **kwargs)
    device = stepped[0].tensor.device.type if stepped else "cpu"
    return eager.AdamW(groups, fused=fused_adamw_on(device) or None, **kwargs)


def _sgd(stepped: list[Stepped], cfg: OptimizerConfig, placements: Placements, layout: MuonLayout | None):
    groups = _decay_groups(stepped, placements, cfg.weight_decay)
    cls = HostOffloadSGD if cfg.optimizer_cpu_offload else eager.SGD
    return cls(groups, lr=cfg.lr, momentum=cfg.sgd_momentum)


def _adam(stepped: list[Stepped], cfg: OptimizerConfig, placements: Placements, layout: MuonLayout | None):
    return adamw(stepped, cfg, placements)


def _muon(stepped: list[Stepped], cfg: OptimizerConfig, placements: Placements, layout: MuonLayout | None):
    layout = layout or MuonLayout()
    matrices = [s for s in stepped if layout.is_matrix(s.param, placements)]
    rest = [s for s in stepped if not layout.is_matrix(s.param, placements)]
    members: list[torch.optim.Optimizer] = [muon([(s.tensor, s.param, s.start) for s in matrices], cfg,
                                                 placements, layout)]
    return Chained([*members, adamw(rest, cfg, placements)])


# The step function of each ``ptdp.config.optimizers.REGISTRY`` entry, by its name (a test checks the two
# name the same optimizers): (stepped, cfg, placements, layout) -> the torch optimizer over ``stepped``.
OPTIMIZERS: dict[str, Callable[..., Inner]] = {"adam": _adam, "sgd": _sgd, "muon": _muon}


def build(stepped: list[Stepped], cfg: OptimizerConfig, placements: Placements | None = None,
          layout: MuonLayout | None = None) -> Inner:
    """The ``--optimizer`` over ``stepped``. ``placements``: decay groups and (Muon) which tensors are
    hidden matrices; ``layout``: where Muon's matrices lie over the ranks (None: one process)."""
    return OPTIMIZERS[cfg.kind](stepped, cfg, Placements() if placements is None else placements, layout)


def state_fields(cfg: OptimizerConfig, placements: Placements, param: nn.Parameter) -> tuple[str, ...]:
    """The per-element state (shaped like ``param``, or like the piece of it a rank steps) ``--optimizer``
    keeps for ``param``: what a checkpoint stores as ``optimizer.<name>.<field>``, as its ``OptimizerSpec``
    declares it (nothing is assumed of a rule that declares nothing). Decided by the parameter alone, so ranks
    holding no piece of it agree."""
    spec = optimizer_spec(cfg.kind)
    matrix = spec.matrices_apart and is_hidden_matrix(placement_of(param, placements), param)
    return spec.fields(cfg, matrix)


def pending_state_bytes(optimizer: Inner, cfg: OptimizerConfig, placements: Placements, of) -> int:
    """Bytes of the fp32 state the optimizer allocates at its first step for the tensors that have none yet;
    ``of(tensor)`` is the parameter a stepped tensor is (a piece of)."""
    state = optimizer.state
    return sum(STATE_FIELD_BYTES * t.numel() * len(state_fields(cfg, placements, of(t)))
               for group in optimizer.param_groups for t in group["params"] if not state.get(t))


def install_state(optimizer: Inner, tensor: torch.Tensor, fields: dict[str, torch.Tensor], steps: int) -> None:
    """Make ``fields`` (tensors shaped or flat like ``tensor``) the optimizer's state for ``tensor`` after
    ``steps`` steps, in the layout its torch optimizer keeps (AdamW: a float32 ``step``, beside the
    parameter for the fused CUDA AdamW and on the CPU otherwise)."""
    member = member_of(optimizer, tensor)
    state = {k: v.detach().reshape(tensor.shape).to(device=tensor.device, dtype=torch.float32).clone()
             for k, v in fields.items()}
    if isinstance(member, torch.optim.AdamW):
        on_device = tensor.device.type != "cpu" and not isinstance(member, HostOffloadAdamW)
        state["step"] = torch.tensor(float(steps), dtype=torch.float32, device=tensor.device if on_device else None)
    member.state[tensor] = state
