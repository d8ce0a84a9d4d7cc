"""The per-operation cost of the hang watchdog's bookkeeping on the hot path, and what it adds to a layer.

    python benchmarks/liveness.py            # a table
    python benchmarks/liveness.py --json     # one JSON object on stdout

What runs on the training thread for liveness (``ptdp/observability/flight_recorder.py``, ``liveness.py``):

- ``flight_recorder.record(...)`` before each communication: returns at once without a watchdog; with one,
  a tuple of the op's kind, group, peers, shape and bytes appended to a ring of 64;
- ``flight_recorder.tick()`` once per executor action: one list increment (plus one CUDA event record on
  a GPU, not measured here);
- the layer hooks (CPU, with a watchdog): per layer call a forward hook that ticks and hangs a gradient
  hook on the output, which ticks in the backward.

Each is timed over many calls, in ns per call, against a bare Python function call measured in the same
run (``ratio_to_call``); the hooks are timed as the forward + backward time of a 4-layer GPT at the nanoGPT CPU recipe's size
(h = 128, s = 64, b = 12) with and without them, alternating step by step (``layer_overhead``: the median
of the per-pair ratios; goal <= 1.01).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch


def _per_call_ns(fn, n: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - start) / n


def op_costs(n: int, repeats: int) -> dict[str, float]:
    """Median ns per call of each hot-path call, and of a bare Python call."""
    from ptdp.observability import flight_recorder

    t = torch.zeros(4, 1024)

    def bare() -> None:
        pass

    calls = {
        "python_call": bare,
        "tick": flight_recorder.tick,
        "record_without_watchdog": lambda: flight_recorder.record("all_reduce", tensor=t, action="bench"),
        "record_with_watchdog": lambda: flight_recorder.record("all_reduce", tensor=t, action="bench"),
    }
    out: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            flight_recorder.enable(name == "record_with_watchdog")
            out[name].append(_per_call_ns(fn, n))
    flight_recorder.enable(False)
    return {k: statistics.median(v) for k, v in out.items()}


def layer_overhead(h: int, s: int, b: int, iters: int, repeats: int) -> dict[str, float]:
    """Forward + backward of one GPT layer, without and with the liveness hooks (alternating repeats)."""
    from ptdp.config import ModelConfig
    from ptdp.models import GPTModel
    from ptdp.observability.liveness import watch_layers

    cfg = ModelConfig(num_layers=4, hidden_size=h, num_attention_heads=4, seq_length=s, hidden_dropout=0.0,
                      attention_dropout=0.0)
    model = GPTModel(cfg, 256, 256)
    tokens = torch.randint(0, 256, (b, s))

    def step() -> None:
        model(tokens).float().sum().backward()

    for _ in range(3):
        step()
    plain, hooked = [], []
    for _ in range(repeats * iters):  # alternate step by step: a loaded machine's drift hits both alike
        start = time.perf_counter()
        step()
        plain.append(time.perf_counter() - start)
        handles = watch_layers([model])
        start = time.perf_counter()
        step()
        hooked.append(time.perf_counter() - start)
        for handle in handles:
            handle.remove()
    p, q = statistics.median(plain), statistics.median(hooked)
    ratios = statistics.median(b / a for a, b in zip(plain, hooked, strict=True))
    return {"step_ms_plain": p * 1e3, "step_ms_hooked": q * 1e3, "layer_overhead": ratios}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    ops = op_costs(args.calls, args.repeats)
    result = {
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread",
        "ns_per_call": {k: round(v, 1) for k, v in ops.items()},
        "ratio_to_call": {k: round(v / ops["python_call"], 2) for k, v in ops.items() if k != "python_call"},
        **{k: round(v, 4) for k, v in layer_overhead(128, 64, 12, args.iters, args.repeats).items()},
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
