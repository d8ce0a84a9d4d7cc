"""Cost of the zero-bubble B/W split: one full backward (B) against I + W, on the CPU.

    python benchmarks/bw_split.py                    # GPT layer and MLP stack, h=512, s=512, b=2
    python benchmarks/bw_split.py --json --threads 1 --repeats 7

For one ptdp GPT ``TransformerLayer`` and a stack of pre-LayerNorm MLP blocks (ptdp's ``MLP``),
times the backward of the same forward three ways (the forward itself is not timed):

- ``B``: one ``torch.autograd.backward``;
- ``new``: I = that backward under ``defer_weight_grads`` (graph freed, wgrad closures kept), then W =
  ``WeightGradStore.run`` (only the wgrad GEMMs and bias/norm reductions) -- ``ModuleStage``'s split;
- ``old``: I = ``autograd.grad`` to the input with ``retain_graph``, then W = ``autograd.backward`` with
  ``inputs=params`` (walks the graph again) -- the executor's split before ``ptdp.parallel.tensor.
  weight_grad``.

- ``B_torch``: B with torch's own linear/norm autograd instead of ptdp's Functions (the default path's
  cost: ``B_over_torch_ops`` should be ~1).

Prints the median of each and the ratios ``new_over_B`` (goal <= 1.05) and ``old_over_B``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Iterator

import torch
from torch import nn

from ptdp.config import ModelConfig
from ptdp.models import MLP, SequencePositions, TransformerLayer, norm
from ptdp.ops import norms, weight_grad
from ptdp.ops.fused import EAGER
from ptdp.ops.weight_grad import defer_weight_grads


class MLPBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln, self.mlp = norm(cfg), MLP(cfg, EAGER)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.ln(x))


@contextlib.contextmanager
def torch_ops() -> Iterator[None]:
    """Forward through torch's own linear/norm autograd (what ptdp ran before the custom Functions)."""
    saved = weight_grad.plain_path, norms.plain_path
    weight_grad.plain_path = norms.plain_path = lambda: True
    try:
        yield
    finally:
        weight_grad.plain_path, norms.plain_path = saved


def time_backward(model: nn.Module, x: torch.Tensor, how: str) -> float:
    x = x.detach().requires_grad_(True)
    with torch_ops() if how == "B_torch" else contextlib.nullcontext():
        y = model(x)
    g = torch.ones_like(y)
    params = [p for p in model.parameters() if p.requires_grad]
    start = time.perf_counter()
    if how in ("B", "B_torch"):
        torch.autograd.backward(y, g)
    elif how == "new":
        with defer_weight_grads(params) as store:
            torch.autograd.backward(y, g)
        store.run()
    else:
        torch.autograd.grad(y, x, g, retain_graph=True)
        torch.autograd.backward(y, g, inputs=params)
    took = time.perf_counter() - start
    for p in params:
        p.grad = None
    return took


def measure(model: nn.Module, x: torch.Tensor, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {"B": [], "new": [], "old": [], "B_torch": []}
    for how in times:  # warm-up
        time_backward(model, x, how)
    for _ in range(repeats):  # interleaved, so machine noise hits all three alike
        for how in times:
            times[how].append(time_backward(model, x, how))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"B_s": med["B"], "new_I_plus_W_s": med["new"], "old_I_plus_W_s": med["old"],
            "new_over_B": med["new"] / med["B"], "old_over_B": med["old"] / med["B"],
            "B_over_torch_ops": med["B"] / med["B_torch"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--seq-length", type=int, default=512)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--mlp-layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    h = args.hidden_size
    cfg = ModelConfig(num_layers=1, hidden_size=h, num_attention_heads=max(1, h // 64), seq_length=args.seq_length,
                      hidden_dropout=0.0, attention_dropout=0.0)
    x = torch.randn(args.micro_batch_size, args.seq_length, h)
    models = {"gpt_layer": TransformerLayer(cfg, EAGER, SequencePositions()),
              f"mlp_stack_{args.mlp_layers}": nn.Sequential(*(MLPBlock(cfg) for _ in range(args.mlp_layers)))}
    for model in models.values():
        for p in model.parameters():
            nn.init.normal_(p, 0.0, 0.02)
    results = {name: measure(model, x, args.repeats) for name, model in models.items()}
    if args.json:
        print(json.dumps(results))
        return
    for name, r in results.items():
        print(f"{name:14s} B {r['B_s'] * 1e3:8.2f} ms   new I+W {r['new_I_plus_W_s'] * 1e3:8.2f} ms "
              f"({r['new_over_B']:.3f}x B)   old I+W {r['old_I_plus_W_s'] * 1e3:8.2f} ms ({r['old_over_B']:.3f}x B)   "
              f"B / B with torch's ops {r['B_over_torch_ops']:.3f}")


if __name__ == "__main__":
    main()
