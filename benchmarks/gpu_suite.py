"""The GPU suite in one prepared script: everything since the last GPU run, in at most 6 minutes of one
H100, written to ONE JSON file.

    python benchmarks/gpu_suite.py --out gpu_suite.json            # on a GPU machine (benchmarks/gpu_suite.sh)
    python benchmarks/gpu_suite.py --parts fp8 pytest_gpu          # a rerun of some parts (same file format)
    python benchmarks/gpu_suite.py --dry-run --out /tmp/dry.json   # on a CPU: every part at toy size

Parts (``benchmarks/gpu_parts.py``; the budgets sum to 325 s, the run is capped at ``--total-s`` 350 s): ``pytest -m gpu``; the 1.3B GPT and a
Llama-1B against plain PyTorch (MFU, time ratio, peak memory); bf16 against FP8 (tokens/s, loss gap after
200 iterations); the MoE grouped GEMM against the loop; ``--optimizer-cpu-offload``'s memory saved and time
cost; context parallelism's flash block against math attention at c = 1; ZeRO-3's per-layer gathers over a
group of one; ZeRO-R's ``--checkpoint-in-cpu``; document-masked attention (reported "not built yet" until
ptdp provides the kernel).

**Isolation.** Each part runs in a process of its own, forked from a server that imported torch once (no
CUDA context is ever made before the fork), in a session of its own: a crash, an out-of-memory or a hang
ends that part only. Its time budget (``--budget-scale`` scales them) is enforced by killing the process
group; a part reports as it goes (``ctx.emit``), so a part stopped by its budget keeps what it measured.
Every part gets a status -- ``ok``, ``failed`` (with the error's last line), ``timeout``, ``skipped``
(this machine cannot run it, one line why) or ``not built yet`` -- and the file is rewritten after each part,
so even a run killed from outside leaves the parts done so far.

``--dry-run`` runs every part on the CPU at toy size (the same code paths, no meaningful numbers) and checks
the JSON's shape (:func:`shape_errors`); it exits 1 if any part failed or a ``ok`` part lacks a key.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STATUSES = ("ok", "failed", "timeout", "skipped", "not built yet")
PYTEST_BUDGET = 90
TOTAL_S = 350  # the whole run: 6 minutes with the server start-up, so that a rerun fits in 15 minutes


# ---------------------------------------------------------------------------------- pytest -m gpu


def gpu_test_files() -> list[str]:
    """The test modules that hold ``gpu``-marked tests (collecting only them is seconds, not the suite's minute),
    the never-run-on-a-GPU ones first: tests/gpu/test_gpu.py's training subprocesses are the slowest, and ran
    before (BENCHMARKS.md), so a budget that runs out stops there."""
    found = [str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text()]
    return sorted(found, key=lambda f: (f.endswith("test_gpu.py"), not f.endswith("test_gpu_features.py"), f))


def part_pytest_gpu(ctx) -> None:
    """``pytest -m gpu`` on the GPU tests, in this (forked, torch already imported) process; the outcome of
    every test as it finishes (a budget that stops it leaves the outcomes so far)."""
    import pytest

    files = gpu_test_files()
    outcomes: dict[str, str] = {}
    failures: list[str] = []

    class Recorder:
        @staticmethod
        def pytest_runtest_logreport(report) -> None:
            if report.when == "call" or report.outcome != "passed":  # setup errors and skips count too
                outcomes[report.nodeid] = "error" if report.failed and report.when != "call" else report.outcome
            if report.failed:
                failures.append(f"{report.nodeid}: {str(report.longrepr).strip().splitlines()[-1][:300]}")
            ctx.emit(**_pytest_counts(outcomes), files=files, failures=failures[-20:], outcomes=outcomes)

    os.chdir(ROOT)
    code = pytest.main(["-m", "gpu", "-q", "-o", "addopts=", "-p", "no:cacheprovider", *files], plugins=[Recorder()])
    ctx.emit(**_pytest_counts(outcomes), files=files, failures=failures[-20:], outcomes=outcomes, exit_code=int(code))


def _pytest_counts(outcomes: dict[str, str]) -> dict[str, int]:
    values = list(outcomes.values())
    return {key: values.count(key) for key in ("passed", "failed", "skipped", "error")}


def all_parts() -> dict:
    from gpu_parts import PARTS

    return {**PARTS, "pytest_gpu": (part_pytest_gpu, PYTEST_BUDGET, ("passed", "failed", "skipped", "error"))}


# ------------------------------------------------------------------------------- running one part


def _emit_to(path: str):
    """``emit(**values)``: merged into the part's result file, rewritten atomically each time."""
    result: dict = {}

    def emit(**values) -> None:
        result.update(values)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, default=str)
        os.replace(tmp, path)

    return emit


def _run_part(name: str, path: str, dry_run: bool) -> None:
    """In the part's own process: a session of its own (the parent kills its group), then the part."""
    os.setsid()
    sys.path.insert(0, str(HERE))
    from gpu_parts import NotBuilt, PartContext, Skipped

    emit = _emit_to(path)
    try:
        all_parts()[name][0](PartContext(dry_run, emit))
    except Skipped as e:
        _status(path, "skipped", str(e))
    except NotBuilt as e:
        _status(path, "not built yet", str(e))
    except BaseException as e:  # noqa: BLE001 -- reported in the file; the exit code says it failed
        _status(path, "failed", f"{type(e).__name__}: {e}".splitlines()[0][:500], traceback.format_exc()[-4000:])
        sys.exit(1)


def _status(path: str, status: str, reason: str, trace: str | None = None) -> None:
    with open(f"{path}.status", "w") as f:
        json.dump({"status": status, "reason": reason, "traceback": trace}, f)


def run_part(ctx: mp.context.BaseContext, name: str, budget_s: float, dry_run: bool, workdir: str) -> dict:
    path = os.path.join(workdir, f"{name}.json")
    start = time.perf_counter()
    proc = ctx.Process(target=_run_part, args=(name, path, dry_run), name=f"gpu_suite-{name}")
    proc.start()
    proc.join(budget_s)
    timed_out = proc.is_alive()
    if timed_out:
        with_group = proc.pid
        try:
            os.killpg(with_group, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.join(5)
    seconds = time.perf_counter() - start
    result = json.loads(Path(path).read_text()) if os.path.exists(path) else {}
    status_file = Path(f"{path}.status")
    told = json.loads(status_file.read_text()) if status_file.exists() else None
    if timed_out:
        status, error = "timeout", f"stopped after its budget of {budget_s:.0f} s"
    elif told is not None:
        status, error = told["status"], told["reason"]
    elif proc.exitcode == 0:
        status, error = "ok", None
    else:
        status, error = "failed", f"the part's process ended with exit code {proc.exitcode} (killed: out of memory?)"
    out = {"status": status, "seconds": round(seconds, 2), "budget_s": budget_s, "result": result, "error": error}
    if told is not None and told.get("traceback"):
        out["traceback"] = told["traceback"]
    return out


# ------------------------------------------------------------------------------------ the report


def shape_errors(report: dict, dry_run: bool) -> list[str]:
    """What is wrong with the report's shape: a part missing, an unknown status, an ``ok`` part without a
    required key; in a dry run also any part that failed or ran out of time."""
    errors = []
    for key in ("benchmark", "dry_run", "device", "torch", "parts", "summary", "total_s"):
        if key not in report:
            errors.append(f"the report has no {key!r}")
    parts = report.get("parts", {})
    for name, (_fn, _budget, required) in all_parts().items():
        part = parts.get(name)
        if part is None:
            if report.get("selected") is None or name in report["selected"]:
                errors.append(f"part {name} is missing")
            continue
        if part.get("status") not in STATUSES:
            errors.append(f"part {name}: status {part.get('status')!r} is not one of {STATUSES}")
        elif part["status"] == "ok":
            errors += [f"part {name}: no {key!r} in its result" for key in required if key not in part["result"]]
        elif dry_run and part["status"] in ("failed", "timeout"):
            errors.append(f"part {name} {part['status']}: {part.get('error')}")
    return errors


def summary(parts: dict) -> dict:
    """The suite's figures, each beside its goal (None where the part did not produce it)."""
    def get(part: str, *keys: str):
        value = parts.get(part, {}).get("result", {})
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    return {
        "gpt_mfu": {"value": get("gpt_1p3b", "mfu"), "goal": ">= 0.55"},
        "gpt_time_over_plain_pytorch": {"value": get("gpt_1p3b", "time_over_plain_pytorch"), "goal": "<= 1.02"},
        "llama_mfu": {"value": get("llama_1b", "mfu"), "goal": ">= 0.55"},
        "llama_time_over_plain_pytorch": {"value": get("llama_1b", "time_over_plain_pytorch"), "goal": "<= 1.02"},
        "fp8_tokens_per_s_over_bf16": {"value": get("fp8", "fp8_tokens_per_s_over_bf16"), "goal": ">= 1.25"},
        "fp8_loss_gap": {"value": get("fp8", "fp8_loss_gap"), "goal": "<= 0.01"},
        "grouped_gemm_speedup_e8": {"value": get("moe_grouped_gemm", "e8", "loop_over_grouped"), "goal": "> 1"},
        "grouped_gemm_speedup_e64": {"value": get("moe_grouped_gemm", "e64", "loop_over_grouped"), "goal": "> 1"},
        "optimizer_offload_memory_saved_gib": {"value": get("optimizer_offload", "memory_saved_gib"),
                                               "goal": f"~ {get('optimizer_offload', 'formula_gib')} (8 B/param)"},
        "optimizer_offload_time_ratio": {"value": get("optimizer_offload", "time_ratio"), "goal": "-"},
        "activation_offload_memory_saved_gib": {"value": get("activation_offload", "memory_saved_gib"),
                                                "goal": f"~ {get('activation_offload', 'formula_gib')} (L·s·b·h·2 B)"},
        "activation_offload_time_ratio": {"value": get("activation_offload", "time_ratio"), "goal": "-"},
        "cp_math_over_flash_memory": {"value": get("cp_flash_attention", "math_over_flash_memory"), "goal": ">> 1"},
        "cp_math_over_flash_time": {"value": get("cp_flash_attention", "math_over_flash_time"), "goal": "> 1"},
        "zero3_layer_gather_max_abs_grad_diff": {"value": get("zero3_layer_gather", "max_abs_grad_diff"),
                                                 "goal": "<= 1e-5"},
        "pytest_gpu": {"value": {k: get("pytest_gpu", k) for k in ("passed", "failed", "error", "skipped")},
                       "goal": "failed = error = 0"},
        "statuses": {name: part["status"] for name, part in parts.items()},
    }


def device_info(dry_run: bool) -> dict:
    import torch

    info = {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node()}
    if dry_run or not torch.cuda.is_available():  # never make a CUDA context in the server's parent
        return {**info, "device": "cpu (dry run)" if dry_run else "no CUDA device"}
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return {**info, "device": smi.stdout.strip() or "CUDA (nvidia-smi gave nothing)"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_suite.json", help="the JSON file written (after every part)")
    parser.add_argument("--dry-run", action="store_true", help="every part on the CPU at toy size; check the JSON")
    parser.add_argument("--parts", nargs="+", default=None, help="only these parts (default: all, in order)")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiply every part's time budget")
    parser.add_argument("--total-s", type=float, default=TOTAL_S,
                        help="the whole run's ceiling: a part gets at most what is left of it (dry runs: x3)")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    parts = all_parts()
    selected = args.parts or list(parts)
    unknown = [name for name in selected if name not in parts]
    if unknown:
        print(f"gpu_suite.py: error: unknown part(s) {', '.join(unknown)}; the parts are {', '.join(parts)}",
              file=sys.stderr)
        return 2
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_suite.py: no CUDA device here: nothing measured (run it on a GPU machine, or --dry-run)")
        return 0
    ctx = mp.get_context("forkserver")
    # each part forks from an interpreter that imported torch, dynamo (the meta-device init imports it) and ptdp
    ctx.set_forkserver_preload(["__main__", "torch", "torch._dynamo", "gpu_parts", "gpu", "ptdp.train.state",
                                "ptdp.train.step", "pytest"])
    started, t0 = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), time.perf_counter()
    report = {"benchmark": "gpu_suite", "dry_run": args.dry_run, **device_info(args.dry_run), "started": started,
              "selected": args.parts, "budget_s": sum(parts[n][1] for n in selected) * args.budget_scale,
              "parts": {}, "summary": {}, "total_s": 0.0}
    with tempfile.TemporaryDirectory(prefix="gpu_suite-") as workdir:
        for name in selected:
            slow = 3 if args.dry_run else 1  # toy sizes on a CPU shared with others
            left = args.total_s * slow - (time.perf_counter() - t0)
            budget = max(1.0, min(parts[name][1] * args.budget_scale * slow, left))
            report["parts"][name] = part = run_part(ctx, name, budget, args.dry_run, workdir)
            report["total_s"] = round(time.perf_counter() - t0, 2)
            report["summary"] = summary(report["parts"])
            Path(args.out).write_text(json.dumps(report, indent=1, default=str))
            print(f"gpu_suite: {name:20s} {part['status']:13s} {part['seconds']:6.1f} s"
                  + (f"  ({part['error']})" if part["error"] else ""), flush=True)
    errors = shape_errors(report, args.dry_run)
    report["shape_errors"] = errors
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    for line in errors:
        print(f"gpu_suite: {line}", file=sys.stderr)
    print(f"gpu_suite: {len(selected)} part(s) in {report['total_s']:.0f} s -> {args.out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
