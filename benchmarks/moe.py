"""Mixture of experts: the cost of the expert computation and of the model, one run.

    python benchmarks/moe.py                         # every part, CPU, one thread
    python benchmarks/moe.py --json --parts experts model --device cuda --dtype bfloat16

Parts (each prints its numbers and ratios against a baseline measured in the same run):

- ``experts``: one process. ``GroupedExperts`` forward + backward over T·k routed rows, ONE grouped GEMM
  per projection (``--moe-grouped-gemm``, ``torch._grouped_mm``) against a loop of one GEMM per expert.
  Reports ``loop_over_grouped`` (> 1: the grouped GEMM is faster).
- ``model``: one process. Training tokens/s (forward + backward) of a Llama-style MoE model against a dense
  model with the SAME ACTIVE parameters (dense ffn = k · expert ffn; the router's E·h is extra) --
  ``moe_over_dense`` is what routing, permutation and the smaller GEMMs cost.
- ``dispatch``: expert parallelism over ``--ep`` CPU processes (gloo): a MoE layer's forward + backward
  with the alltoall dispatcher against the allgather one (``ptdp.parallel.expert.dispatch``), T/e tokens
  per rank. Reports ``allgather_over_alltoall`` (> 1: all-to-all is faster).

Median of ``--repeats`` timed iterations after ``--warmup``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from ptdp.config import ModelConfig, MoEConfig
from ptdp.models import GPTModel, GroupedExperts
from ptdp.ops.grouped import grouped_mm_available
from ptdp.runtime.exit import exit_now


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn: Callable[[], None], device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_experts(args: argparse.Namespace) -> dict:
    """Grouped GEMM against a loop over the experts: forward + backward of the expert MLPs."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    e, k, h, f, tokens = args.experts, args.topk, args.hidden, args.expert_ffn, args.tokens
    cfg = ModelConfig(hidden_size=h, num_attention_heads=8, ffn_hidden_size=f, swiglu=True)
    torch.manual_seed(0)
    counts = torch.distributions.Dirichlet(torch.ones(e)).sample() * tokens * k  # uneven, as routing is
    counts = counts.floor().long()
    counts[-1] += tokens * k - int(counts.sum())
    x = torch.randn(tokens * k, h, device=device, dtype=dtype, requires_grad=True)
    out = {"experts": e, "topk": k, "hidden": h, "expert_ffn": f, "routed_rows": tokens * k,
           "grouped_mm_available": grouped_mm_available(device, dtype)}
    for grouped in (False, True):
        experts = GroupedExperts(cfg, MoEConfig(num_experts=e, moe_grouped_gemm=grouped)).to(device, dtype)
        for p in experts.parameters():
            torch.nn.init.normal_(p, std=0.02)

        def step(experts: GroupedExperts = experts) -> None:
            experts(x, counts).sum().backward()

        out["grouped_s" if grouped else "loop_s"] = median_seconds(step, device, args.warmup, args.repeats)
    out["loop_over_grouped"] = out["loop_s"] / out["grouped_s"]
    return out


def _model(moe: MoEConfig | None, ffn: int, args: argparse.Namespace) -> GPTModel:
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8, ffn_hidden_size=ffn,
                      seq_length=args.seq, hidden_dropout=0.0, attention_dropout=0.0,
                      position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
                      untie_embeddings_and_output_weights=True)
    torch.manual_seed(0)
    model = GPTModel(cfg, 1024, 1024, moe).to(args.device, getattr(torch, args.dtype))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return model.train()


def bench_model(args: argparse.Namespace) -> dict:
    """Tokens/s of an MoE model and of the dense model with the same active parameters."""
    from ptdp.parallel.tensor.random import MODEL_PARALLEL_RNG, get_rng_tracker

    if MODEL_PARALLEL_RNG not in get_rng_tracker().states:
        get_rng_tracker().add(MODEL_PARALLEL_RNG, 0)
    device = torch.device(args.device)
    batch = max(1, args.tokens // args.seq)
    tokens = torch.randint(0, 1024, (batch, args.seq), device=device)
    moe = MoEConfig(num_experts=args.experts, moe_router_topk=args.topk, moe_grouped_gemm=True,
                    moe_aux_loss_coeff=0.01)
    models = {"moe": _model(moe, args.expert_ffn, args), "dense": _model(None, args.topk * args.expert_ffn, args)}
    out = {"layers": args.layers, "tokens_per_iteration": batch * args.seq}
    for name, model in models.items():
        def step(model: GPTModel = model) -> None:
            model(tokens).float().logsumexp(-1).mean().backward()

        seconds = median_seconds(step, device, args.warmup, args.repeats)
        params = sum(p.numel() for p in model.parameters())
        out[name] = {"tokens_per_s": batch * args.seq / seconds, "parameters": params}
    out["moe_over_dense"] = out["moe"]["tokens_per_s"] / out["dense"]["tokens_per_s"]
    return out


def _dispatch_rank(rank: int, world: int, store: str, args: argparse.Namespace, queue) -> None:
    """One expert-parallel rank: a MoE layer's forward + backward with each dispatcher, in turn."""
    import torch.distributed as dist

    from ptdp.models.moe import MoELayer
    from ptdp.parallel.expert.apply import apply_expert_parallel
    from ptdp.parallel.expert.dims import ExpertDims, ExpertParallel
    from ptdp.parallel.placement import Placements

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    expert = ExpertParallel(ExpertDims(world, 1, world, 1), rank, torch.device("cpu"))
    cfg = ModelConfig(hidden_size=args.hidden, num_attention_heads=8, ffn_hidden_size=args.expert_ffn, swiglu=True)
    torch.manual_seed(rank)
    x = torch.randn(1, args.tokens // world, args.hidden, requires_grad=True)  # this rank's tokens
    out = {}
    for kind in ("alltoall", "allgather"):
        torch.manual_seed(0)
        layer = MoELayer(cfg, MoEConfig(num_experts=args.experts, moe_router_topk=args.topk, moe_grouped_gemm=True))
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.02)
        apply_expert_parallel(layer, expert, Placements(), kind)

        def step(layer: MoELayer = layer) -> None:
            layer(x).sum().backward()

        dist.barrier()
        out[f"{kind}_s"] = median_seconds(step, torch.device("cpu"), args.warmup, args.repeats)
    times = [None] * world
    dist.all_gather_object(times, out)
    if rank == 0:
        queue.put({k: max(t[k] for t in times) for k in out})  # the slowest rank sets the step time
    queue.close()
    queue.join_thread()  # the put is through before the process leaves without the interpreter's teardown
    dist.barrier()
    dist.destroy_process_group()
    exit_now(0)  # not through the interpreter's teardown, which gloo's threads can abort (ptdp/runtime/exit.py)


def bench_dispatch(args: argparse.Namespace) -> dict:
    """Expert parallelism over ``--ep`` CPU processes (gloo): a MoE layer's forward + backward with the
    alltoall dispatcher (the baseline) against the allgather one, same tokens and weights, each the slowest
    rank's median."""
    import os
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(), "store")
    procs = [ctx.Process(target=_dispatch_rank, args=(r, args.ep, store, args, queue)) for r in range(args.ep)]
    for proc in procs:
        proc.start()
    result = queue.get(timeout=600)
    for proc in procs:
        proc.join()
    out = {"ep": args.ep, "experts": args.experts, "topk": args.topk, "tokens": args.tokens, **result}
    out["allgather_over_alltoall"] = out["allgather_s"] / out["alltoall_s"]
    return out


PARTS: dict[str, Callable[[argparse.Namespace], dict]] = {"experts": bench_experts, "model": bench_model,
                                                          "dispatch": bench_dispatch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="*", default=list(PARTS), choices=list(PARTS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--expert-ffn", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per iteration (T)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ep", type=int, default=4, help="dispatch: expert-parallel CPU processes")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    torch.set_num_threads(args.threads)
    results = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
               "dtype": args.dtype, "torch": torch.__version__}
    for part in args.parts:
        results[part] = PARTS[part](args)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for part in args.parts:
        print(f"{part}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in results[part].items()))


if __name__ == "__main__":
    main()
