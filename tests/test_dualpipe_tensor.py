"""Tensor-parallel collectives as exchanges of the overlapped pairs (issue 38: "dense models overlap their
pipeline sends and tensor-parallel collectives the same way").

Run in pieces under t > 1, a transformer layer cuts at its tensor-parallel collectives (``Linear.entry`` /
``exit``, ``ptdp.parallel.tensor.transfers``): the attention's and the MLP's input region (``f``: backward
all-reduce; with sequence parallelism the all-gather, backward reduce-scatter) and output reduction (``g``:
all-reduce; the reduce-scatter, backward all-gather) are exchanges issued asynchronously and waited on by
the piece that consumes them, never a collective inside a compute piece. Shown on two gloo ranks, piece by
piece against the layer's plain autograd run, and trained: dualpipev at p = 2 with t = 2 on a dense model,
with sequence parallelism, and with MoE (e = 2 folded over t) equals one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import TINY, assert_equivalent, pooled_spawn, run_layouts, validated_config

DENSE = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4", "--seq-length", "8",
         "--vocab-size", "32", "--hidden-dropout", "0", "--attention-dropout", "0"]
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
               "reduce_scatter_single")


def _check_layer_pieces(rank: int, world: int, sp: bool) -> None:
    from ptdp.models import GPTModel
    from ptdp.models.pieces import BackwardRun, Compute, Exchange, ForwardRun, fuse, interleave
    from ptdp.parallel.placement import Placements
    from ptdp.parallel.tensor.apply import apply_tensor_parallel

    cfg = validated_config(DENSE)
    model = GPTModel(cfg.model, 32, 32)
    apply_tensor_parallel(model, dist.group.WORLD, Placements(), sequence_parallel=sp)
    generator = torch.Generator().manual_seed(7 + rank)
    for param in model.parameters():
        param.data.normal_(0, 0.3, generator=generator)
    layers = list(model.layers.values())

    def program(x: str) -> list:
        steps = []
        for i, layer in enumerate(layers):
            steps += layer.steps(x, f"layer{i}")
            x = f"layer{i}"
        return steps

    steps = program("x")
    for i, layer in enumerate(layers):
        names = [s.name for s in steps if isinstance(s, Exchange) and s.output.startswith(f"layer{i}.")]
        assert names == ["attention_in", "attention_out", "mlp_in", "mlp_out"], names  # the collectives

    # Issued collectives: (inside a compute piece, asynchronous); a synchronous one inside a piece fails.
    inside, calls = [False], []
    for fn in COLLECTIVES:
        if hasattr(dist, fn):
            real = getattr(dist, fn)

            def spy(*args, _real=real, _fn=fn, **kwargs):
                calls.append((_fn, inside[0], kwargs.get("async_op", False)))
                return _real(*args, **kwargs)

            setattr(dist, fn, spy)

    def watched(step):
        if not isinstance(step, Compute):
            return step

        def run(*args):
            inside[0] = True
            try:
                return step.run(*args)
            finally:
                inside[0] = False

        return Compute(run, step.inputs, step.outputs, step.name)

    s = 8 // world if sp else 8
    xs = [torch.randn(2, s, 16, generator=generator).requires_grad_(True) for _ in range(2)]
    dys = [torch.randn(2, s, 16, generator=generator) for _ in range(2)]
    # the plain autograd run: two microbatches, one after the other
    plain = []
    for x, dy in zip(xs, dys):
        y = x
        for layer in layers:
            y = layer(y)
        y.backward(dy)
        plain.append(x.grad.clone())
    params = dict(model.layers.named_parameters())
    grads = {n: p.grad.clone() for n, p in params.items()}
    model.zero_grad()
    calls.clear()
    # in pieces: microbatch 0's forward, then its backward interleaved with microbatch 1's forward
    first = ForwardRun([watched(st) for st in fuse(program("x"))], {"x": xs[0].detach().requires_grad_(True)})
    first.finish()
    out = f"layer{len(layers) - 1}"
    back = BackwardRun(first, {out: dys[0]})
    second = ForwardRun([watched(st) for st in fuse(program("x"))], {"x": xs[1].detach().requires_grad_(True)})
    interleave(second, back)
    second_back = BackwardRun(second, {out: dys[1]})
    second_back.finish()
    torch.testing.assert_close(back.grad("x"), plain[0], rtol=0, atol=0)
    torch.testing.assert_close(second_back.grad("x"), plain[1], rtol=0, atol=0)
    for name, param in params.items():
        torch.testing.assert_close(param.grad, grads[name], rtol=1e-6, atol=1e-7, msg=name)
    tp = calls
    assert tp and not any(within for _, within, _ in tp), calls  # none inside a compute piece
    assert all(asynchronous for _, _, asynchronous in tp), calls
    per_layer = {False: {"all_reduce"}, True: {"all_gather_into_tensor", "all_gather_single",
                                                 "reduce_scatter_tensor", "reduce_scatter_single"}}[sp]
    assert {fn for fn, _, _ in tp} <= per_layer


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_a_dense_layer_under_tensor_parallelism_exchanges_its_collectives_asynchronously(tmp_path, sp):
    pooled_spawn(_check_layer_pieces, 2, tmp_path, sp)


# ------------------------------------------------------------------ trained: dualpipev equals one process

DUALPIPEV_T2 = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "dualpipev",
                "--tensor-model-parallel-size", "2"]
TRAIN_MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
             "--moe-layer-freq", "2", "--moe-token-dispatcher-type", "alltoall"]
LAYOUTS = {
    "dense-t2": ("one", 4, DUALPIPEV_T2),
    "dense-t2-sp": ("one", 4, [*DUALPIPEV_T2, "--sequence-parallel"]),
    "moe-t2e2": ("one-moe", 4, [*DUALPIPEV_T2, *TRAIN_MOE, "--expert-model-parallel-size", "2",
                                "--expert-tensor-parallel-size", "1"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    plan = {"one": (1, []), "one-moe": (1, TRAIN_MOE)}
    plan.update({name: (world, flags) for name, (_, world, flags) in LAYOUTS.items()})
    return run_layouts(tmp_path_factory.mktemp("dualpipe-tensor"), plan, base=TINY)


@pytest.mark.parametrize("name", LAYOUTS)
def test_dualpipev_with_tensor_parallel_exchanges_trains_as_one_process(runs, name):
    assert_equivalent(runs[name], runs[LAYOUTS[name][0]])
