"""Peak stashed activations per rank: pipeline schedules, activation recomputation, sequence parallelism.

Each case trains one iteration of a small GPT with ``ptdp train`` on 4 real CPU processes and reads
``peak_activation_bytes``: the bytes autograd saved for backward (saved-tensor hooks in the pipeline
executor), at their peak over the schedule, on the worst rank. Beside it:

- ``formula_bytes``: the paper's count (Korthikanti et al.; docs/references.md, §Memory),
  s·b·h·(34 + 5·a·s/h) bytes per layer per microbatch at 16 bits, x2 for fp32, times the layers of a
  chunk l/(p·v), times the microbatches rank 0 keeps in flight. It knows nothing of t, recomputation
  or sequence parallelism: it is the baseline they shrink.
- ``planner_bytes``: ``ptdp.planner``'s prediction for the worst rank, built from its
  ``activation_bytes_per_layer`` (which does split by t, sequence parallelism and recomputation), x2 for
  fp32, ``activation_microbatches_in_flight``, and the fp32 logits on the last rank. Its
  ``memory_per_gpu`` also adds the working set one fully recomputed layer rebuilds during its backward;
  that transient is not a stash, so it is reported apart (``planner_recompute_working_bytes``).

Dropout is on (0.1), as in the formula, which counts the dropout masks.

The zero-bubble and V schedules keep a stash from its F until its W (the executor frees saved
bytes at B, or at W when the backward is split). ``stashed_ratio_to_1f1b`` is the prediction from the
lists themselves: ``schedules.peak_stashed`` on the worst rank times the layers of a chunk, over 1F1B's;
the papers claim zb-h1 ≈ 1x, zb-h2 ≈ 2x, zbv ≈ 1x, v-half ≈ 0.5x, v-min ≈ 0.33x (docs/references.md, §Zero-bubble and V schedules).

``korthikanti_bytes`` is Korthikanti et al.'s count with tensor parallelism, s·b·h·(10 + 24/t +
5·a·s/(h·t)) per layer per microbatch, and s·b·h·(34 + 5·a·s/h)/t with sequence parallelism (the
column-parallel linears keep their s/t-token input, ``ptdp/parallel/sequence/linear.py``);
``peak_resident_bytes`` is the worst worker's peak RSS (VmHWM) over the run.

    python benchmarks/memory.py            # table
    python benchmarks/memory.py --json     # one JSON object keyed by case
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ptdp.config import ModelConfig
from ptdp.data.tokenizer import ByteTokenizer
from ptdp.planner.memory import activation_bytes_per_layer, activation_microbatches_in_flight
from ptdp.planner.spec import GPTSpec, ParallelConfig
from ptdp.schedule.actions import peak_stashed
from ptdp.schedule.registry import build_schedule

WORLD = 4
MODEL = {"num_layers": 8, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64}
MICRO_BATCH, GLOBAL_BATCH = 2, 16


@dataclass(frozen=True)
class Case:
    t: int = 1
    p: int = 4
    v: int = 1
    schedule: str = "1f1b"
    recompute: str | None = None
    sequence_parallel: bool = False
    flags: list[str] = field(default_factory=list)

    def args(self) -> list[str]:
        args = ["--tensor-model-parallel-size", str(self.t), "--pipeline-model-parallel-size", str(self.p),
                "--virtual-pipeline-model-parallel-size", str(self.v), "--pipeline-schedule", self.schedule]
        if self.recompute:
            args += ["--recompute-granularity", self.recompute]
        return args + (["--sequence-parallel"] if self.sequence_parallel else [])


CASES = {
    "gpipe": Case(schedule="gpipe"),
    "1f1b": Case(),
    "interleaved": Case(v=2, schedule="interleaved"),
    "1f1b_recompute_full": Case(recompute="full"),
    "1f1b_recompute_selective": Case(recompute="selective"),
    "1f1b_tp2": Case(t=2, p=2),  # the baseline sequence parallelism is measured against
    "1f1b_sequence_parallel": Case(t=2, p=2, sequence_parallel=True),
    "zb-h1_tp2": Case(t=2, p=2, schedule="zb-h1"),  # the zero-bubble split, weight grads deferred to W
    "zb-h1_sequence_parallel": Case(t=2, p=2, schedule="zb-h1", sequence_parallel=True),
    "zb-h1": Case(schedule="zb-h1"),
    "zb-h2": Case(schedule="zb-h2"),
    "zbv": Case(v=2, schedule="zbv"),
    "v-half": Case(v=2, schedule="v-half"),
    "v-min": Case(v=2, schedule="v-min"),
}


def measure(case: Case, workdir: Path) -> dict:
    """Train one iteration on WORLD processes; the rank-0 metrics record (worst-rank values)."""
    metrics = workdir / f"metrics-{os.urandom(4).hex()}.jsonl"
    model = [f"--{k.replace('_', '-')}={v}" for k, v in MODEL.items()]
    cmd = [sys.executable, "-m", "ptdp", "train", *model, "--micro-batch-size", str(MICRO_BATCH),
           "--global-batch-size", str(GLOBAL_BATCH), "--train-iters", "1", "--hidden-dropout", "0.1",
           "--attention-dropout", "0.1", *case.args(), "--nproc-per-node", str(WORLD),
           "--metrics-file", str(metrics)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if proc.returncode:
        raise SystemExit(f"memory.py: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(metrics.read_text().splitlines()[-1])


def stashed_layers(case: Case) -> int:
    """Worst rank's ``peak_stashed`` of the schedule's own lists, in layers (stashes x layers per chunk)."""
    d = WORLD // (case.t * case.p)
    m = GLOBAL_BATCH // (MICRO_BATCH * d)
    peak = max(peak_stashed(build_schedule(case.schedule, case.p, case.v, m, r)) for r in range(case.p))
    return peak * MODEL["num_layers"] // (case.p * case.v)


def predictions(case: Case) -> dict:
    """The paper's formula (fp32, t = 1, no recomputation) and the planner's worst-rank prediction."""
    spec = GPTSpec(vocab_size=ByteTokenizer.vocab_size, **MODEL)
    s, b, h, a = spec.seq_length, MICRO_BATCH, spec.hidden_size, spec.num_attention_heads
    d = WORLD // (case.t * case.p)
    m = GLOBAL_BATCH // (MICRO_BATCH * d)
    layers_per_chunk = spec.num_layers // (case.p * case.v)
    in_flight = [activation_microbatches_in_flight(case.schedule, case.p, case.v, m, r) for r in range(case.p)]
    formula = 2 * s * b * h * (34 + 5 * a * s / h) * layers_per_chunk * in_flight[0]
    # Korthikanti et al. with t: 10 + 24/t + 5as/(ht) per s·b·h; sequence parallelism divides the 10 too
    t = case.t
    per_sbh = (34 + 5 * a * s / h) / t if case.sequence_parallel else 10 + 24 / t + 5 * a * s / (h * t)
    korthikanti = 2 * s * b * h * per_sbh * layers_per_chunk * in_flight[0]
    cfg = ParallelConfig(case.t, case.p, d, case.v, MICRO_BATCH, case.recompute or "none",
                         sequence_parallel=case.sequence_parallel)
    stash = 2 * activation_bytes_per_layer(spec, cfg)  # the planner counts 16-bit activations
    working = 2 * activation_bytes_per_layer(spec, cfg, stashed=False) if case.recompute == "full" else 0
    padded_vocab = ModelConfig(**MODEL).padded_vocab_size(spec.vocab_size, case.t)
    logits = 4 * s * b * padded_vocab / case.t  # fp32 logits of one microbatch on the last rank
    planner = max(n * layers_per_chunk * stash + (logits if r == case.p - 1 else 0) for r, n in enumerate(in_flight))
    # the executor measures what is stashed; a full-recompute unit's rebuilt working set is reported apart
    return {"in_flight_formula": in_flight[0], "formula_bytes": int(formula), "planner_bytes": int(planner),
            "korthikanti_bytes": int(korthikanti),
            "planner_recompute_working_bytes": int(working)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object keyed by case")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases:
            case = CASES[name]
            record = measure(case, Path(tmp))
            measured = record["peak_activation_bytes"]
            pred = predictions(case)
            results[name] = {
                "layout": {"t": case.t, "p": case.p, "d": WORLD // (case.t * case.p), "v": case.v,
                           "schedule": case.schedule, "recompute": case.recompute,
                           "sequence_parallel": case.sequence_parallel},
                "peak_activation_bytes": measured,
                "peak_in_flight_microbatches": record["peak_in_flight_microbatches"],
                **pred,
                "measured_over_formula": round(measured / pred["formula_bytes"], 3),
                "measured_over_korthikanti": round(measured / pred["korthikanti_bytes"], 3),
                "peak_resident_bytes": max(record["peak_resident_bytes_per_rank"]),
                "measured_over_planner": round(measured / pred["planner_bytes"], 3),
                "ratio_to_1f1b": None,
                "stashed_layers": stashed_layers(case),
                "stashed_ratio_to_1f1b": round(stashed_layers(case) / stashed_layers(CASES["1f1b"]), 3),
            }
    if "1f1b" in results:
        for r in results.values():
            r["ratio_to_1f1b"] = round(r["peak_activation_bytes"] / results["1f1b"]["peak_activation_bytes"], 3)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"model {MODEL}, b={MICRO_BATCH}, B={GLOBAL_BATCH}, {WORLD} processes, fp32, dropout 0.1")
    print(f"{'case':26s} {'t,p,d,v':>8s} {'in-flight':>9s} {'measured MB':>12s} {'formula MB':>11s} "
          f"{'planner MB':>11s} {'Korth. MB':>10s} {'peak RSS MB':>12s} {'/1f1b':>6s} {'predicted':>9s}")
    for name, r in results.items():
        lay = r["layout"]
        print(f"{name:26s} {lay['t']},{lay['p']},{lay['d']},{lay['v']:>2} {r['peak_in_flight_microbatches']:9d} "
              f"{r['peak_activation_bytes'] / 1e6:12.3f} {r['formula_bytes'] / 1e6:11.3f} "
              f"{r['planner_bytes'] / 1e6:11.3f} {r['korthikanti_bytes'] / 1e6:10.3f} "
              f"{r['peak_resident_bytes'] / 1e6:12.1f} {r['ratio_to_1f1b'] or float('nan'):6.2f} "
              f"{r['stashed_ratio_to_1f1b']:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
