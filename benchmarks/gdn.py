"""Gated DeltaNet layers: time against s, and what context parallelism costs per rank in each mode.

``layer``: one Gated DeltaNet layer (h = 64, 2 key / 4 value heads of 32) forward + backward in one CPU
process at s = 1k ... 32k tokens: milliseconds, and per token (flat when the layer is linear in s).

``cp``: a layer of 4 key / 8 value heads of 16 at c = 2 and 4 real CPU processes (gloo), ``state_passing`` against
``a2a`` (``ptdp.parallel.context.linear``), per s: the bytes this rank hands to the collectives in one
forward + backward (the wrappers below count every tensor it sends: an all-gather's input, an all-to-all's
chunks for the other ranks, a reduce-scatter's input), the largest tensor a collective returns to it (the
exchange's buffer), and the bytes autograd saves for the backward (the layer's activations on this rank).

    python benchmarks/gdn.py layer
    python benchmarks/gdn.py cp --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

H = 64
LAYER = (2, 4, 32)  # key heads, value heads, head width of the timed layer
CP_LAYER = (4, 8, 16)  # the same widths over more heads, so that c = 4 divides the key heads (a2a)


def _layer(key_heads: int, value_heads: int, width: int):
    from ptdp.config import ModelConfig
    from ptdp.models.gated_deltanet import GatedDeltaNet

    torch.manual_seed(0)
    layer = GatedDeltaNet(ModelConfig(
        hidden_size=H, norm_epsilon=1e-6, experimental_attention_variant="gated_delta_net",
        linear_key_head_dim=width, linear_value_head_dim=width, linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.1)
    return layer


def layer_times(seqs: list[int], repeats: int) -> list[dict]:
    layer, rows = _layer(*LAYER), []
    for s in seqs:
        x = torch.randn(1, s, H, requires_grad=True)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            layer(x).sum().backward()
            best = min(best, time.perf_counter() - start)
        rows.append({"seq_length": s, "ms": best * 1e3, "us_per_token": best * 1e6 / s})
    for row in rows:
        row["per_token_vs_first"] = row["us_per_token"] / rows[0]["us_per_token"]
    return rows


class _Counter:
    """Wraps the collectives of ``ptdp.observability.communication`` to count what this rank sends."""

    def __init__(self, c: int):
        from ptdp.observability import communication
        from ptdp.parallel import collectives

        self.sent, self.buffer, self.c = 0, 0, c
        for name in ("all_gather_single", "reduce_scatter_single", "all_to_all_single"):
            wrapped = self._wrap(name, getattr(communication, name))
            setattr(communication, name, wrapped)
            if hasattr(collectives, name):  # imported by name there
                setattr(collectives, name, wrapped)

    def _wrap(self, name, original):
        def counted(output, input, *args, **kwargs):
            size = input.numel() * input.element_size()
            self.sent += size * (self.c - 1) // self.c if name == "all_to_all_single" else size
            self.buffer = max(self.buffer, output.numel() * output.element_size())
            return original(output, input, *args, **kwargs)
        return counted


def _cp_rank(rank: int, c: int, store: str, mode: str, seqs: list[int], out: str) -> None:
    import torch.distributed as dist

    from ptdp.parallel.context.linear import apply_linear_context_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=c)
    counter = _Counter(c)
    layer = _layer(*CP_LAYER)
    apply_linear_context_parallel(layer, dist.group.WORLD, mode)
    rows = []
    for s in seqs:
        x = torch.randn(1, s // c, H, requires_grad=True)
        counter.sent = counter.buffer = 0
        saved: list[int] = []

        def keep(t: torch.Tensor, saved: list[int] = saved) -> torch.Tensor:
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            y = layer(x)
        y.sum().backward()
        rows.append({"mode": mode, "c": c, "seq_length": s, "bytes_sent": counter.sent,
                     "exchange_buffer_bytes": counter.buffer, "saved_activation_bytes": sum(saved)})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def cp_costs(seqs: list[int], cps: list[int]) -> list[dict]:
    import torch.multiprocessing as mp

    rows = []
    for c in cps:
        for mode in ("state_passing", "a2a"):
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "rows.json")
                mp.spawn(_cp_rank, args=(c, os.path.join(tmp, "store"), mode, seqs, out), nprocs=c)
                with open(out) as f:
                    rows += json.load(f)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["layer", "cp"])
    parser.add_argument("--seqs", type=int, nargs="+", default=None)
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.what == "layer":
        rows = layer_times(args.seqs or [1024, 2048, 4096, 8192, 16384, 32768], args.repeats)
    else:
        rows = cp_costs(args.seqs or [1024, 4096, 16384], args.cps)
    if args.json:
        print(json.dumps({"rows": rows}))
    else:
        keys = list(rows[0])
        print(" ".join(f"{k:>22}" for k in keys))
        for row in rows:
            print(" ".join(f"{row[k]:>22.3f}" if isinstance(row[k], float) else f"{row[k]:>22}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
