"""Which parameters Muon steps, and the matrices it orthogonalises in each, read from the placement records.

The usual split (Keller Jordan's, Moonshot's, Megatron-Core's ``get_megatron_muon_optimizer``): Muon on the
2-D *hidden* weights, AdamW on everything else. Here a parameter is Muon's when its placement
(``ptdp.parallel.placement``) says it is a weight matrix of the transformer layers: role ``dense`` or
``expert`` (not a vocabulary slice, not the last stage's copy of the tied embedding), weight-decayed (Megatron's
rule: not a bias, not a norm) and at least 2-D, and not the embedding or the output layer
(``embedding.*``, ``lm_head.*``). That is QKV, the attention output, the MLP's fc1/fc2, each expert's fc1/fc2,
the router and the shared-expert gate.

A parameter holds one or more independent matrices, as separate ``nn.Linear`` would under
``torch.optim.Muon``; each is orthogonalised on its own (:class:`Unit`: a contiguous leading slice of the
parameter, so a ZeRO shard of it is a contiguous range too):

* the last two dimensions are the matrix (``[out, in]``); leading dimensions index independent ones: the
  fused q/k/v of ``[3, a·d, h]``, gate and up of SwiGLU's ``[2, f, h]``, each expert of ``[E, g, f, h]``
  and ``[E, h, f]`` (ptdp.models.layers.Linear, ptdp.models.moe.GroupedExperts);
* grouped-query attention's QKV ``[(a + 2G)·d, h]`` holds, per head group, its a/G query heads then its key
  and value head (Megatron's order): Q, K and V are the rows of each kind across the groups (Megatron-Core's
  ``split_qkv``), three matrices of one unit; ``--muon-no-split-qkv`` makes any QKV one ``[rows, h]`` matrix.

A unit's tensor may be split over a tensor-parallel group (a placement ``Split`` on axis ``tp`` or ``etp``,
always on one of the matrix dimensions): ``ptdp.optim.muon_exchange`` assembles it whole before Newton–Schulz.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from ptdp.optim.newton_schulz import newton_schulz_flops, scale_factor
from ptdp.parallel.placement import TP_AXES, Placement

OUTSIDE = ("embedding.", "lm_head.")  # the input embedding (and positions) and the untied output layer


def is_hidden_matrix(placement: Placement, param: nn.Parameter) -> bool:
    """Whether Muon steps ``param`` (module docstring); AdamW steps the rest."""
    return (placement.role in ("dense", "expert") and placement.weight_decay and param.dim() >= 2
            and not placement.name.startswith(OUTSIDE))


@dataclass(frozen=True)
class Matrix:
    """One matrix of a unit: rows ``ranges`` (all rows when None) of the full unit viewed as ``[rows, cols]``,
    its shape, and the factor (``--muon-scale-mode``, ``--muon-extra-scale-factor``) its update is scaled by."""

    ranges: tuple[tuple[int, int], ...] | None
    shape: tuple[int, int]
    scale: float


@dataclass(frozen=True)
class Unit:
    """What is orthogonalised together: elements ``[start, end)`` of ``param.view(-1)`` (this rank's local
    parameter), shaped ``local_shape``; the full tensor is ``split_size`` such pieces concatenated along
    ``split_dim`` over the ``tp_axis`` group (None: replicated, every rank of that group holds all of it)."""

    name: str
    param: nn.Parameter
    role: str
    start: int
    end: int
    local_shape: tuple[int, ...]
    split_dim: int | None
    split_size: int
    matrices: tuple[Matrix, ...]

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def full_shape(self) -> tuple[int, ...]:
        shape = list(self.local_shape)
        if self.split_dim is not None:
            shape[self.split_dim] *= self.split_size
        return tuple(shape)

    def flops(self, steps: int) -> float:
        return sum(newton_schulz_flops(*m.shape, steps) for m in self.matrices)


@dataclass(frozen=True)
class QKVLayout:
    """How the QKV weight of grouped-query attention orders its rows (``ptdp.models.attention.Attention``)."""

    heads_per_group: int  # a / G
    head_dim: int  # d

    def matrices(self, rows: int) -> list[tuple[tuple[int, int], ...]]:
        """The row ranges of Q, K and V in a ``[(a + 2G)·d, h]`` weight."""
        d, q = self.head_dim, self.heads_per_group * self.head_dim
        per_group = q + 2 * d
        groups = range(rows // per_group)
        return [tuple((g * per_group + lo, g * per_group + hi) for g in groups)
                for lo, hi in ((0, q), (q, q + d), (q + d, q + 2 * d))]


def units_of(param: nn.Parameter, placement: Placement, *, qkv: QKVLayout | None, split_qkv: bool,
             scale_mode: str, extra_scale: float) -> list[Unit]:
    """The units of one Muon parameter of this rank (module docstring)."""
    shape = tuple(param.shape)
    tp = [s for s in placement.splits if s.axis in TP_AXES and s.size > 1]
    if len(tp) > 1:
        raise ValueError(f"{placement.name}: split over more than one tensor-parallel axis {tp}")
    split = tp[0] if tp else None
    is_qkv = placement.name.endswith("attention.qkv.weight")
    whole = is_qkv and not split_qkv  # one matrix, however the weight is laid out
    lead = 0 if whole else len(shape) - 2  # dimensions that index independent matrices
    if split is not None and split.dim < lead:
        raise ValueError(f"{placement.name}: its {split.axis} split (dimension {split.dim}) cuts across matrices")
    local = shape[lead:]
    count, size = math.prod(shape[:lead]), math.prod(local)
    split_dim = None if split is None else split.dim - lead
    full = list(local)
    if split_dim is not None:
        full[split_dim] *= split.size
    rows, cols = math.prod(full[:-1]), full[-1]
    if is_qkv and split_qkv and qkv is not None and len(shape) == 2:
        ranges = qkv.matrices(rows)
        matrices = tuple(Matrix(r, (sum(hi - lo for lo, hi in r), cols),
                                scale_factor(sum(hi - lo for lo, hi in r), cols, scale_mode, extra_scale))
                         for r in ranges)
    else:
        matrices = (Matrix(None, (rows, cols), scale_factor(rows, cols, scale_mode, extra_scale)),)
    return [Unit(f"{placement.name}[{k}]" if count > 1 else placement.name, param, placement.role,
                 k * size, (k + 1) * size, local, split_dim, split.size if split else 1, matrices)
            for k in range(count)]
