"""Expert parallelism applied to a plain MoE model: keep this rank's experts, install a token dispatcher.

The MoE layer (``ptdp.models.moe.MoELayer``) holds its experts stacked: every parameter of ``layer.experts``
is ``[E, ...]``. On expert-parallel rank r of e, :func:`apply_expert_parallel` keeps rows
``[r·E/e, (r+1)·E/e)`` (on the meta device: nothing allocated) and swaps the layer's ``LocalDispatcher`` for
the ``alltoall`` or ``allgather`` one (``expert_dispatch.py``). Parameter names do not change; each expert
parameter is marked ``expert_parallel`` with its split (``expert_parallel_size``, ``expert_parallel_rank``),
which initialisation (``init.py``: the one-process values, then this rank's rows), checkpoints (a
``Shard(0)`` DTensor on the expert-parallel mesh, so the saved tensor is the global ``[E, ...]`` one and a
checkpoint reshards across e) and the optimizer read: expert gradients are reduced over the expert-data-
parallel group (``ptdp.parallel.expert.grads``), and each expert element counts once in the gradient norm.

Applied whenever the model has MoE layers, even at e = 1 (groups of one: the collectives are no-ops), so the
same dispatcher code runs in every layout.
"""

from __future__ import annotations

from torch import nn

from ptdp.parallel.expert.dims import ExpertParallel
from ptdp.parallel.expert.dispatch import DISPATCHERS
from ptdp.parallel.expert.load_balancing import split_sequence_load_balancing


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
EXPERT_TENSOR_DIM = {"fc1_weight": 2, "fc2_weight": 2}


def _keep(param: nn.Parameter, dim: int, size: int, rank: int) -> nn.Parameter:
    shape = list(param.shape)
    shape[dim] //= size
    data = (param.new_empty(shape) if param.is_meta
            else param.detach().narrow(dim, rank * shape[dim], shape[dim]).clone())
    new = nn.Parameter(data, requires_grad=param.requires_grad)
    new.__dict__.update(param.__dict__)
    return new


def slice_experts(experts: nn.Module, num_experts: int, size: int, rank: int, mesh=None,
                  tensor_size: int = 1, tensor_rank: int = 0) -> None:
    """Keep rows ``[rank·E/size, (rank+1)·E/size)`` of every stacked ``[E, ...]`` expert parameter, in place,
    and with ``tensor_size`` > 1 this rank's 1/tensor_size of each expert's FFN; ``mesh`` is the expert
    ``DeviceMesh`` the checkpoint shards on (None for one rank)."""
    for module in experts.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if param.shape[0] != num_experts:
                raise ValueError(f"expert parameter {name} {tuple(param.shape)} is not stacked over the "
                                 f"{num_experts} experts")
            new = _keep(param, 0, size, rank)
            new.expert_parallel = True
            new.expert_parallel_size, new.expert_parallel_rank = size, rank
            new.expert_shard_dims = (0,)
            if tensor_size > 1:
                if name not in EXPERT_TENSOR_DIM:
                    raise ValueError(f"expert parameter {name}: no expert-tensor-parallel split is known for it")
                new = _keep(new, EXPERT_TENSOR_DIM[name], tensor_size, tensor_rank)
                # read by init (the one-process tensor, then this rank's piece) like a TP-split weight
                new.tensor_model_parallel, new.partition_dim = True, EXPERT_TENSOR_DIM[name]
                new.expert_shard_dims = (0, EXPERT_TENSOR_DIM[name])
            new.expert_mesh = mesh  # checkpoints: Shard(0) [and Shard(2)] of the global tensor on this mesh
            module._parameters[name] = new


def apply_expert_parallel(model: nn.Module, expert: ExpertParallel | None, dispatcher: str = "alltoall",
                          sequence_parallel: bool = False) -> nn.Module:
    """Split every MoE layer of ``model`` over ``expert``'s expert-parallel group in place; returns it.

    ``expert`` None (or a world of one) keeps every expert and routes with the chosen dispatcher over a group
    of one. ``dispatcher`` is ``--moe-token-dispatcher-type``. Under ``sequence_parallel`` (t > 1) each
    tensor-parallel rank routes its own tokens: the router, the shared expert and its gate, replicated over
    TP, then get partial gradients and are marked ``sequence_parallel`` (summed over TP after the backward);
    with etp = t the dispatcher gathers the routed tokens over the expert-tensor group first.
    """
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"--moe-token-dispatcher-type must be one of {sorted(DISPATCHERS)}, got {dispatcher!r}")
    ep_group = None if expert is None else expert.ep_group
    token_group = None if expert is None else expert.token_group
    size = 1 if expert is None else expert.dims.ep
    rank = 0 if expert is None else expert.ep_rank
    for layer in moe_layers(model):
        n = num_experts_of(layer)
        etp = 1 if expert is None else expert.dims.etp
        slice_experts(layer.experts, n, size, rank, None if expert is None else expert.expert_mesh,
                      etp, 0 if expert is None else expert.etp_rank)
        layer.dispatcher = DISPATCHERS[dispatcher](n, ep_group, token_group,
                                                   None if expert is None else expert.etp_group, sequence_parallel)
        if expert is not None and expert.sequence_group is not None:  # each rank routes part of a sequence
            split_sequence_load_balancing(layer.router, expert.sequence_group, expert.sequence_scale,
                                          expert.z_loss_scale)
        if sequence_parallel:
            for param in layer.parameters():
                if not is_expert_param(param):
                    param.sequence_parallel = True
    return model


def is_expert_param(param: nn.Parameter) -> bool:
    return getattr(param, "expert_parallel", False)
