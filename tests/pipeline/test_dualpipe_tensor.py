"""Tensor-parallel collectives as exchanges of the overlapped pairs: dense models overlap their
pipeline sends and tensor-parallel collectives the same way.

Run in pieces under t > 1, a transformer layer cuts at its tensor-parallel collectives (where its model
declares a half may be cut and the split linears communicate: ``ptdp.parallel.pipeline.program``,
``ptdp.parallel.tensor.transfers``): the attention's and the MLP's input region (``f``: backward
all-reduce; with sequence parallelism the all-gather, backward reduce-scatter) and output reduction (``g``:
all-reduce; the reduce-scatter, backward all-gather) are exchanges issued asynchronously and waited on by
the piece that consumes them, never a collective inside a compute piece. Shown on two gloo ranks, piece by
piece against the layer's plain autograd run, and trained: dualpipev at p = 2 with t = 2 on a dense model,
with sequence parallelism (and full recomputation), with MoE (e = 2 folded over t), and combined 1F1B at t = 2
with --delay-wgrad-compute, equal one process. The NCCL model plays the new order: two microbatches'
transfers interleaved on one rank, alike on every rank of the tensor-parallel group.
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
    from ptdp.parallel.pipeline.program import layer_pieces
    from ptdp.parallel.placement import Placements
    from ptdp.parallel.tensor.apply import apply_tensor_parallel
    from ptdp.planner.memory import cut_layer_extra_bytes
    from ptdp.planner.spec import GPTSpec, ParallelConfig
    from ptdp.simulate.nccl.pairs import Label, Recorder, chunk_program

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
            steps += layer_pieces(layer, model.pipeline_parts().cuts, x, f"layer{i}")
            x = f"layer{i}"
        return steps

    steps = program("x")
    for i in range(len(layers)):
        names = [s.name for s in steps if isinstance(s, Exchange) and s.output.startswith(f"layer{i}.")]
        assert names == ["attention_in", "attention_out", "mlp_in", "mlp_out"], names  # the collectives
    # the NCCL model's mirror cuts the layers where the real ones are cut (names and kinds, in order)
    mirror, _ = chunk_program(False, False, 0, "alltoall", False, False, Recorder([]), Label("F", 0, 0),
                              layers=[False] * len(layers), tensor="sp" if sp else "tp")
    assert [(type(a).__name__, a.name) for a in steps] == [(type(a).__name__, a.name) for a in mirror]

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
    # What the pieces keep beyond the plain run: the planner's price of a cut layer (fp32 here, 16-bit there)
    weights = {p.data_ptr() for p in model.parameters()}

    def kept(forward) -> int:
        elements = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            elements[0] += 0 if t.data_ptr() in weights else t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward()
        return elements[0]

    def plain_forward():
        y = xs[0]
        for layer in layers:
            y = layer(y)

    extra = kept(lambda: ForwardRun(fuse(program("x")), {"x": xs[0].detach().requires_grad_(True)}).finish()) \
        - kept(plain_forward)
    spec = GPTSpec.from_model_config(cfg.model)
    price = cut_layer_extra_bytes(spec, ParallelConfig(world, 1, 1, micro_batch_size=2, sequence_parallel=sp))
    assert extra * 2 == price * len(layers), (extra, price)  # none without sequence parallelism
    assert extra > 0 if sp else extra == 0
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
    "dense-t2-sp-recompute": ("one", 4, [*DUALPIPEV_T2, "--sequence-parallel", "--recompute-granularity", "full",
                                         "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
    "moe-t2e2": ("one-moe", 4, [*DUALPIPEV_T2, *TRAIN_MOE, "--expert-model-parallel-size", "2",
                                "--expert-tensor-parallel-size", "1"]),
    # combined 1F1B at t = 2, the weight gradients of a piece whose input gradient leaves delayed past the issue
    "moe-t2e2-1f1b-overlap-delay": ("one-moe", 4, [
        "--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2", *TRAIN_MOE,
        "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
        "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    plan = {"one": (1, []), "one-moe": (1, TRAIN_MOE)}
    plan.update({name: (world, flags) for name, (_, world, flags) in LAYOUTS.items()})
    return run_layouts(tmp_path_factory.mktemp("dualpipe-tensor"), plan, base=TINY)


@pytest.mark.parametrize("name", LAYOUTS)
def test_dualpipev_with_tensor_parallel_exchanges_trains_as_one_process(runs, name):
    assert_equivalent(runs[name], runs[LAYOUTS[name][0]])


# ------------------------------------------------------------- the NCCL model: two microbatches' TP transfers

def assert_safe(trace: dict, *what) -> None:
    from ptdp.simulate.nccl.model import check_all_send_models

    for model, problems in check_all_send_models(trace).items():
        assert not problems, (what, model, problems[:3])


@pytest.mark.parametrize("tensor", ["tp", "sp"])
@pytest.mark.parametrize("name, v, overlap", [("dualpipev", 2, False), ("1f1b", 1, True), ("interleaved", 2, True)])
def test_tensor_parallel_transfers_interleave_alike_on_every_rank_of_a_group(tensor, name, v, overlap):
    """In each pair the tensor-parallel transfers of one microbatch's forward and another's backward
    interleave (with the expert ones, e folded over t, and the synchronous ones of the embedding, the head,
    the loss and the token slicing) in the order the pieces engine issues them; every rank of the group the
    same: deadlock-free under NCCL's rules, with recomputation, both dispatchers, p = 2 and 4."""
    from ptdp.simulate.nccl.experts import record_expert_trace

    for p in (2, 4):
        for layers, dispatcher, recompute in (([False, False], "alltoall", False), ([False, True], "alltoall", True),
                                              ([True, False], "allgather", False)):
            trace = record_expert_trace(name, p, v, 2 * p + 1 if name == "dualpipev" else 2 * p, pipelines=2,
                                        layers=layers, dispatcher=dispatcher, recompute=recompute, tensor=tensor,
                                        overlap=overlap)
            assert_safe(trace, p, layers, dispatcher, recompute)


def _tp_issues(trace: dict, rank: int) -> list[list]:
    return [e["issue"][0]["msg"] for e in trace["ranks"][rank] if e.get("comm") == "tp"]


def test_a_pair_really_interleaves_the_two_microbatches_tensor_parallel_transfers():
    from ptdp.simulate.nccl.experts import record_expert_trace

    trace = record_expert_trace("dualpipev", 2, 2, 4, pipelines=2, layers=[False, False], tensor="tp")
    # rank 0's first pair: F3 on chunk 0 (stage 0) with B1 on chunk 1 (stage 3)
    owners = [(mb, stage) for name, mb, stage in _tp_issues(trace, 0)
              if (mb, stage) == (3, 0) and name.startswith("tp F:") or (mb, stage) == (1, 3) and name.startswith("tp B:")]
    assert len(set(owners)) == 2
    assert sum(a != b for a, b in zip(owners, owners[1:])) >= 3, owners  # not one microbatch's, then the other's


def test_tensor_parallel_ranks_interleaving_differently_are_caught():
    """One rank of a tensor-parallel group issues two microbatches' transfers in the other order: caught."""
    from ptdp.simulate.nccl.experts import record_expert_trace
    from ptdp.simulate.nccl.model import check_trace

    trace = record_expert_trace("dualpipev", 2, 2, 4, pipelines=2, layers=[False], tensor="sp")
    events = trace["ranks"][2]  # pipeline 1's rank 0, in a tensor-parallel group with pipeline 0's rank 0
    tp = [i for i, e in enumerate(events) if e.get("comm") == "tp"]
    for i, j in zip(tp, tp[1:]):
        a, b = events[i]["issue"][0]["msg"], events[j]["issue"][0]["msg"]
        if (a[1], a[2]) != (b[1], b[2]):
            events[i], events[j] = events[j], events[i]
            break
    else:
        pytest.fail("no two adjacent transfers of different microbatches")
    problems = check_trace(trace, sends_wait_for_receive=True)
    assert any(line.startswith(("mismatch", "deadlock")) for line in problems), problems
