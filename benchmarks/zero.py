"""ZeRO stages 1-3: model-state bytes, peak memory and iteration time per strategy, on 4 CPU
processes, against ZeRO's formulas and against ``no_shard`` measured in the same run.

    python benchmarks/zero.py                      # ~100M GPT, d=4 and p=2 x d=2, every strategy
    python benchmarks/zero.py --layouts d4 --iters 4 --json
    python benchmarks/zero.py --layouts d4 --strategies no_shard optim_grads_params optim_grads_params+reshard \
        optim_grads_params+reshard-noprefetch --iters 3 --rounds 2     # per-layer prefetch on / off
    python benchmarks/zero.py --model 1b-l4 --layouts d4 --strategies optim_grads_params+reshard --iters 2
                                                   # the run's peak per rank, extrapolated to the 1B preset
    python benchmarks/zero.py --model 1b --layouts d4 --strategies optim_grads_params+reshard --iters 2  # capacity

Each case is one ``ptdp train`` of a few iterations (fp32, dropout off, one microbatch per rank) and reads
the metrics JSONL: ``model_state_bytes_per_rank`` (distinct storages held after the step:
ptdp/optim/memory.py), ``peak_memory_bytes_per_rank`` (each worker's resident-set high-water mark over
the last iteration; device memory on a GPU; ``MALLOC_MMAP_THRESHOLD_`` = 128 KiB, as in
checkpoint_memory.py, so tensors freed mid-step go back to the system instead of staying in glibc's heap) and the median ``iteration_time_s`` after the first iteration.
Formulas (fp32 Adam, Ψ = a rank's parameters, measured as no_shard's bytes / 16; docs/references.md, §ZeRO):
no_shard 16Ψ, optim 8Ψ + 8Ψ/d, optim_grads 4Ψ + 12Ψ/d, optim_grads_params 16Ψ/d. Stage 3 also holds, during
the step, the gathered parameters of its chunks (4Ψ; ptdp keeps a chunk gathered through its backward).
Goals: stage 3 states <= 1.05 x 16Ψ/d (+ a chunk's gathered parameters, which the step's peak shows),
stage 2 within 10% of its formula, stage 3 time <= 1.15 x no_shard. Timings on a shared 2-core machine are
noisy: read the ratios, not the seconds; ``--rounds R`` interleaves R passes over the strategies and takes
the median of the per-round ratios to that round's no_shard.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODELS = {  # byte vocabulary (padded to 384 at t = 1)
    "100m": ["--num-layers", "14", "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "64"],
    "300m": ["--num-layers", "16", "--hidden-size", "1280", "--num-attention-heads", "16", "--seq-length", "16"],
    "1b": ["--num-layers", "16", "--hidden-size", "2304", "--num-attention-heads", "16", "--seq-length", "16"],
    # 1b's width with fewer layers: every per-layer transient exactly as at 1b, a fraction of its states
    "1b-l2": ["--num-layers", "2", "--hidden-size", "2304", "--num-attention-heads", "16", "--seq-length", "16"],
    "1b-l4": ["--num-layers", "4", "--hidden-size", "2304", "--num-attention-heads", "16", "--seq-length", "16"],
}
VOCAB = 257  # the byte tokenizer of the mock data (bytes + end of document)


def num_params(model: str) -> int:
    """The preset's parameter count (built on the meta device: no memory)."""
    import torch

    from ptdp.cli.main import build_parser
    from ptdp.config import config_from_args
    from ptdp.models import GPTModel

    cfg = config_from_args(build_parser().parse_args(["train", *MODELS[model]]))
    with torch.device("meta"):
        gpt = GPTModel(cfg.model, VOCAB, cfg.model.padded_vocab_size(VOCAB, 1), cfg.moe)
    return sum(p.numel() for p in gpt.parameters())


def extrapolate(rows: list[dict], target: str) -> list[dict]:
    """Per (layout, strategy): the run's peak RSS per rank (start-up included) at ``target``, from the
    largest model measured (so measure models of ``target``'s width only): its peak plus the model states' formula (bytes/parameter at this d) times the
    extra parameters. Exact in the states when the measured model has ``target``'s width and fewer layers
    (``1b-l4`` for ``1b``): what else is held (runtime, one gathered layer, its gradient buckets) does not
    grow with depth. (A line through two depths is not: the first gathered layer's bucket neighbours
    change from l = 2 to 4 and would read as a slope.)"""
    out = []
    for key in sorted({(r["layout"], r["strategy"]) for r in rows}):
        pts = sorted((num_params(r["model"]), max(r["peak_resident_bytes_per_rank"]), r["model"]) for r in rows
                     if (r["layout"], r["strategy"]) == key)
        psi, peak, model = pts[-1]
        per_param = FORMULA[key[1]](WORLD // (2 if key[0] == "p2d2" else 1))
        target_psi = num_params(target)
        out.append({"layout": key[0], "strategy": key[1], "target": target, "params": target_psi, "from": model,
                    "bytes_per_param": per_param, "fixed_bytes": int(peak - per_param * psi),
                    "predicted_peak_bytes_per_rank": int(peak + per_param * (target_psi - psi))})
    return out


LAYOUTS = {"d4": [], "p2d2": ["--pipeline-model-parallel-size", "2"]}
# "...+reshard": stage 3 with --reshard-after-forward (with p = 1: gathered per layer, ptdp/parallel/data/zero_layers.py,
# each layer's all-gather prefetched one layer ahead); "...+reshard-noprefetch": the same with synchronous
# per-layer gathers (``LayerParamSync(prefetch=False)``), the baseline for the prefetch: benchmark-only, its
# workers run this file (``--worker``), which swaps the class before ptdp builds it.
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params", "optim_grads_params+reshard",
              "optim_grads_params+reshard-noprefetch")
FORMULA = {"no_shard": lambda d: 16, "optim": lambda d: 8 + 8 / d, "optim_grads": lambda d: 4 + 12 / d,
           "optim_grads_params": lambda d: 16 / d, "optim_grads_params+reshard": lambda d: 16 / d,
           "optim_grads_params+reshard-noprefetch": lambda d: 16 / d}
WORLD = 4


def run(model: str, layout: str, strategy: str, iters: int, workdir: Path) -> dict:
    metrics = workdir / f"{model}-{layout}-{strategy}.jsonl"
    metrics.unlink(missing_ok=True)  # ptdp appends to --metrics-file: a later --rounds pass reads its own only
    train = ["train", *MODELS[model], *LAYOUTS[layout], "--data-parallel-sharding-strategy", strategy.split("+")[0],
             *(["--reshard-after-forward"] if "+reshard" in strategy else []), "--micro-batch-size", "1",
             "--global-batch-size", str(WORLD // (2 if layout == "p2d2" else 1)), "--train-iters", str(iters),
             "--lr", "1e-4", "--lr-warmup-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
             "--log-interval", "1", "--metrics-file", str(metrics)]
    cmd = [sys.executable, "-m", "ptdp", *train, "--nproc-per-node", str(WORLD)]
    if strategy.endswith("-noprefetch"):  # torchrun as ptdp's launcher calls it, on this file's worker entry
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
               __file__, "--worker", *train]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)})
    if proc.returncode:
        raise SystemExit(f"zero.py: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    last = records[-1]
    times = [r["iteration_time_s"] for r in records[1:]] or [records[0]["iteration_time_s"]]
    return {"layout": layout, "strategy": strategy, "model_state_bytes_per_rank": last["model_state_bytes_per_rank"],
            "peak_memory_bytes_per_rank": last["peak_memory_bytes_per_rank"],
            "peak_resident_bytes_per_rank": last["peak_resident_bytes_per_rank"], "model": model,
            "iteration_time_s": statistics.median(times), "losses": [r["loss"] for r in records],
            "load_average_1min": round(os.getloadavg()[0], 1)}


def merge_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One row per strategy from ``--rounds`` R passes over the strategy list (interleaved, so a change of
    the machine's load hits every strategy): its time is the median of its per-round medians and its time
    ratio the median of the per-round ratios to that round's no_shard (``compare``)."""
    for rows in rounds:
        compare(rows)
    merged = []
    for k, last in enumerate(rounds[-1]):
        mine = [rows[k] for rows in rounds]
        row = {**last, "iteration_time_s": statistics.median(r["iteration_time_s"] for r in mine),
               "iteration_time_s_per_round": [r["iteration_time_s"] for r in mine],
               "load_average_1min": [r["load_average_1min"] for r in mine]}
        if "time_over_no_shard" in last:
            row["time_over_no_shard_per_round"] = [r["time_over_no_shard"] for r in mine]
            row["time_over_no_shard"] = round(statistics.median(row["time_over_no_shard_per_round"]), 3)
        merged.append(row)
    return merged


def compare(rows: list[dict]) -> None:
    """Ratios against the formulas (Ψ per rank from no_shard when it ran) and against no_shard's time."""
    base = next((r for r in rows if r["strategy"] == "no_shard"), None)
    for r in rows:
        d = WORLD // (2 if r["layout"] == "p2d2" else 1)
        psi = [b / 16 for b in base["model_state_bytes_per_rank"]] if base else None
        if psi:
            formula = [FORMULA[r["strategy"]](d) * p for p in psi]
            r["formula_bytes_per_rank"] = [int(f) for f in formula]
            r["states_over_formula"] = round(max(m / f for m, f in zip(r["model_state_bytes_per_rank"], formula,
                                                                         strict=True)), 4)
            r["time_over_no_shard"] = round(r["iteration_time_s"] / base["iteration_time_s"], 3)
            r["peak_over_no_shard"] = round(max(r["peak_memory_bytes_per_rank"])
                                            / max(base["peak_memory_bytes_per_rank"]), 3)
            r["same_losses_as_no_shard"] = all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(r["losses"], base["losses"],
                                                                                          strict=True))


def worker(argv: list[str]) -> int:
    """A ``ptdp train`` worker whose per-layer ZeRO-3 gathers are synchronous (the noprefetch variant)."""
    from ptdp.cli.main import main as ptdp_main
    from ptdp.parallel.data import zero_layers

    class NoPrefetch(zero_layers.LayerParamSync):
        def __init__(self, grads, layers):
            super().__init__(grads, layers, prefetch=False)

    zero_layers.LayerParamSync = NoPrefetch  # strategy.GatherPlan looks it up when the reducer is built
    return ptdp_main(argv)


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        raise SystemExit(worker(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", choices=MODELS, default=["100m"],
                        help="also the run's peak per rank extrapolated to --extrapolate-to (from the largest)")
    parser.add_argument("--extrapolate-to", choices=MODELS, default="1b")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES[:4]))
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="pass over the strategies R times (interleaved)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.model:
            for layout in args.layouts:
                out += merge_rounds([[run(model, layout, s, args.iters, Path(tmp)) for s in args.strategies]
                                     for _ in range(args.rounds)])
    fits = extrapolate(out, args.extrapolate_to) if args.model != [args.extrapolate_to] else []
    if args.json:
        print(json.dumps(out + fits, indent=1))
        return
    mib = 2**20
    print(f"GPT {' '.join(args.model)}, fp32, {WORLD} CPU processes, {args.iters} iterations per case, "
          f"{args.rounds} round(s); peak: the last iteration's; run peak: the whole run's, start-up included (max "
          f"over ranks); load average (1 min) after each case: {[r['load_average_1min'] for r in out]}")
    print(f"{'model':5} {'layout':6} {'strategy':38} {'states MiB/rank':>15} {'/formula':>9} {'peak MiB':>9} "
          f"{'run peak MiB':>12} {'peak/no_shard':>14} {'iter s':>8} {'time/no_shard':>14}  "
          "per round: iter s, time/no_shard")
    for r in out:
        print(f"{r['model']:5} {r['layout']:6} {r['strategy']:38} {max(r['model_state_bytes_per_rank']) / mib:15.1f} "
              f"{r.get('states_over_formula', float('nan')):9.3f} {max(r['peak_memory_bytes_per_rank']) / mib:9.1f} "
              f"{max(r['peak_resident_bytes_per_rank']) / mib:12.1f} "
              f"{r.get('peak_over_no_shard', float('nan')):14.3f} {r['iteration_time_s']:8.2f} "
              f"{r.get('time_over_no_shard', float('nan')):14.3f}  {r['iteration_time_s_per_round']} "
              f"{r.get('time_over_no_shard_per_round', '')}")
    for f in fits:
        print(f"{f['layout']} {f['strategy']}: run peak per rank = {f['fixed_bytes'] / mib:.0f} MiB + "
              f"{f['bytes_per_param']:.2f} B x params (from {f['from']}) -> {f['target']} ({f['params'] / 1e9:.2f}B "
              "params): "
              f"{f['predicted_peak_bytes_per_rank'] / 2**30:.2f} GiB per rank, "
              f"{WORLD * f['predicted_peak_bytes_per_rank'] / 2**30:.1f} GiB for {WORLD} ranks")


if __name__ == "__main__":
    main()
