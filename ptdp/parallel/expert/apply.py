"""Expert parallelism applied to a plain MoE model: keep this rank's experts, install a token dispatcher.

The MoE layer (``ptdp.models.moe.MoELayer``) holds its experts stacked: every parameter of ``layer.experts``
is ``[E, ...]``. On expert-parallel rank r of e, :func:`apply_expert_parallel` keeps rows
``[r·E/e, (r+1)·E/e)`` (on the meta device: nothing allocated) and swaps the layer's ``LocalDispatcher`` for
the ``alltoall`` or ``allgather`` one (``expert_dispatch.py``). Parameter names do not change; each expert
parameter's placement (``ptdp.parallel.placement``) gets the role ``expert`` and its split
``Split("ep", 0, e, ep_rank)`` (then ``Split("etp", 2, etp, etp_rank)`` under expert tensor parallelism),
which initialisation (``init.py``: the one-process values, then this rank's rows), checkpoints (a
``Shard(0)`` DTensor on the expert mesh's ``ep`` dimension, so the saved tensor is the global ``[E, ...]``
one and a checkpoint reshards across e) and the optimizer read: expert gradients are reduced over the
expert-data-parallel group (``ptdp.parallel.expert.grads``), and each expert element counts once in the
gradient norm.

Applied whenever the model has MoE layers, even at e = 1 (groups of one: the collectives are no-ops), so the
same dispatcher code runs in every layout.
"""

from __future__ import annotations

from torch import nn

from ptdp.parallel.expert.dims import ExpertParallel
from ptdp.parallel.expert.dispatch import DISPATCHERS
from ptdp.parallel.expert.load_balancing import split_sequence_load_balancing
from ptdp.parallel.placement import Placements, Split


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The MoE layers of ``model`` (a model or pipeline chunk): modules with a router, experts and a
    dispatcher (the seam of ``ptdp.models.moe``)."""
    return [m for m in model.modules() if all(hasattr(m, a) for a in ("router", "experts", "dispatcher"))]


def num_experts_of(layer: nn.Module) -> int:
    n = getattr(layer, "num_experts", None)
    if n is None:
        n = next(layer.experts.parameters()).shape[0]
    return int(n)


# Expert tensor parallelism splits each expert's FFN dimension f: dim 2 of ``fc1_weight [E, g, f, h]`` and of
# ``fc2_weight [E, h, f]`` (``ptdp.models.moe.GroupedExperts``).
EXPERT_TENSOR_DIM = {"fc1_weight": 2, "fc2_weight": 2, "fc1_bias": 2}  # fc2_bias [E, h]: no split (refused)


def _keep(param: nn.Parameter, dim: int, size: int, rank: int) -> nn.Parameter:
    shape = list(param.shape)
    shape[dim] //= size
    data = (param.new_empty(shape) if param.is_meta
            else param.detach().narrow(dim, rank * shape[dim], shape[dim]).clone())
    return nn.Parameter(data, requires_grad=param.requires_grad)


def slice_experts(experts: nn.Module, num_experts: int, size: int, rank: int, placements: Placements,
                  tensor_size: int = 1, tensor_rank: int = 0) -> None:
    """Keep rows ``[rank·E/size, (rank+1)·E/size)`` of every stacked ``[E, ...]`` expert parameter, in place,
    and with ``tensor_size`` > 1 this rank's 1/tensor_size of each expert's FFN, recording both splits."""
    for module in experts.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if param.shape[0] != num_experts:
                raise ValueError(f"expert parameter {name} {tuple(param.shape)} is not stacked over the "
                                 f"{num_experts} experts")
            new = _keep(param, 0, size, rank)
            placements.replace(param, new)
            placements.update(new, role="expert")
            placements.add_split(new, Split("ep", 0, size, rank))
            if tensor_size > 1:
                if name not in EXPERT_TENSOR_DIM:
                    raise ValueError(f"expert parameter {name}: no expert-tensor-parallel split is known for it")
                piece = _keep(new, EXPERT_TENSOR_DIM[name], tensor_size, tensor_rank)
                placements.replace(new, piece)
                placements.add_split(piece, Split("etp", EXPERT_TENSOR_DIM[name], tensor_size, tensor_rank))
                new = piece
            module._parameters[name] = new


def apply_expert_parallel(model: nn.Module, expert: ExpertParallel | None, placements: Placements,
                          dispatcher: str = "alltoall", sequence_parallel: bool = False) -> nn.Module:
    """Split every MoE layer of ``model`` over ``expert``'s expert-parallel group in place, recording the
    splits in ``placements``; returns it.

    ``expert`` None (or a world of one) keeps every expert and routes with the chosen dispatcher over a group
    of one. ``dispatcher`` is ``--moe-token-dispatcher-type``. Under ``sequence_parallel`` (t > 1) each
    tensor-parallel rank routes its own tokens: the router, the shared expert and its gate, replicated over
    TP, then get partial gradients and are recorded ``partial_over`` TP (summed after the backward);
    with etp = t the dispatcher gathers the routed tokens over the expert-tensor group first.
    """
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"--moe-token-dispatcher-type must be one of {sorted(DISPATCHERS)}, got {dispatcher!r}")
    ep_group = None if expert is None else expert.ep_group
    token_group = None if expert is None else expert.token_group
    size = 1 if expert is None else expert.dims.ep
    rank = 0 if expert is None else expert.ep_rank
    placements.adopt(model)  # a plain model's parameters (a pipeline chunk's are recorded already)
    for layer in moe_layers(model):
        n = num_experts_of(layer)
        etp = 1 if expert is None else expert.dims.etp
        slice_experts(layer.experts, n, size, rank, placements, etp, 0 if expert is None else expert.etp_rank)
        layer.dispatcher = DISPATCHERS[dispatcher](n, ep_group, token_group,
                                                   None if expert is None else expert.etp_group, sequence_parallel)
        if expert is not None and expert.sequence_group is not None:  # each rank routes part of a sequence
            split_sequence_load_balancing(layer.router, expert.sequence_group, expert.sequence_scale,
                                          expert.z_loss_scale)
        if sequence_parallel:
            for param in layer.parameters():
                if placements[param].role != "expert":
                    placements.add_partial(param, "tp")
    return model
