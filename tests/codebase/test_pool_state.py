"""A training run in a rank of the session's pool (``helpers.run_layouts``, and ``train_metrics``/``train_run``
for one plain process) is what a fresh ``ptdp train`` process computes: the pool's ranks live through many
runs, so whatever state ptdp keeps per process must not carry from one run to the next."""

import ast
import json
import re
from pathlib import Path

from helpers import TINY, run_ptdp, track, train_metrics

PTDP = Path(__file__).resolve().parents[2] / "ptdp"

# Every module-level container ptdp mutates after import, and `global` it rebinds, with why a run in the
# pool cannot see an earlier run's: a new one must be added here after that question is answered.
KNOWN = {
    "checkpointing/storage.py:_VERIFIED": "cleared before each run (helpers._forget_earlier_runs)",
    "data/mix_state.py:_IDENTITIES": "cleared before each run (helpers._forget_earlier_runs)",
    "data/default_corpus.py:_NAMES": "the standard library's file list and sizes: the same for a process's life",
    "optim/memory.py:_lifetime_peak": "reset before each run, with /proc/self/clear_refs (helpers._forget_earlier_runs)",
    "parallel/tensor/random.py:_TRACKER": "rebuilt and reseeded by every run (model_parallel_seed)",
    "ops/weight_grad.py:_AT_ONCE": "weak references: an entry leaves with its parameter",
    "ops/fused.py:_compiled_ops": "--compile only, which never runs in the pool (helpers._OWN_PROCESS_FLAGS)",
    "ops/grouped.py:_SUPPORT": "what the machine's kernels support: the same in every process",
    "parallel/recompute.py:_OFFLOAD_STREAMS": "CUDA streams: no GPU in the pool",
    "observability/flight_recorder.py:COUNTS": "hang-report counters: in no metric, hang tests run `ptdp train`",
    "observability/flight_recorder.py:_OPS": "the hang report's last collectives (as COUNTS)",
    "observability/flight_recorder.py:_ENABLED": "hang-report switch, set by every run",
    "observability/flight_recorder.py:DEVICE": "GPU watchdog only",
    "observability/flight_recorder.py:_SOLO": "hang-report phase, restored on leaving it",
    "data/preprocess.py:_worker": "`ptdp preprocess`'s worker processes only",
    "data/preprocess_sft.py:_worker": "`ptdp preprocess --sft`'s worker processes only (as preprocess.py's)",
    "runtime/phases.py:_RUNNING": "a stack of `with` blocks, unwound at their end",
    "runtime/interrupt.py:_STATE": "Ctrl-C state: interrupt.install never runs in the pool, no signal reaches it",
    "runtime/launcher_stop.py:_LAUNCHER": "the launcher's (not in the pool)",
    "runtime/launch.py:_REPORTED_BY_WORKERS": "the launcher's (not in the pool)",
    "runtime/collector.py:_paused": "paused only by the `ptdp` command's own process (main() without argv), "
                                    "never in the pool; resume() there finds it unset",
    "runtime/signals.py:_CALLBACKS": "installed by interrupt.install only (not in the pool)",
    "runtime/signals.py:_INSTALLED": "installed by interrupt.install only (not in the pool)",
    "runtime/signals.py:_THREAD": "installed by interrupt.install only (not in the pool)",
}

_CONTAINERS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
_MUTATORS = r"\.(append|extend|update|add|clear|pop|popitem|setdefault|remove|discard|insert)\(|\[[^\]]*\]\s*[+\-]?="


def _called(call: ast.Call) -> str | None:
    return getattr(call.func, "id", None) or getattr(call.func, "attr", None)


def _process_state() -> set[str]:
    found = set()
    for path in PTDP.rglob("*.py"):
        text = path.read_text()
        tree = ast.parse(text)
        where = path.relative_to(PTDP).as_posix()
        names = set()
        for node in tree.body:
            value = getattr(node, "value", None)
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            if isinstance(target, ast.Name) and (isinstance(value, _CONTAINERS) or (
                    isinstance(value, ast.Call) and _called(value) in ("dict", "list", "set", "deque", "defaultdict"))):
                names.add(target.id)
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            body = ast.get_source_segment(text, fn) or ""
            found.update(f"{where}:{name}" for name in names if re.search(rf"\b{name}(?:{_MUTATORS})", body))
            for node in ast.walk(fn):
                if isinstance(node, ast.Global):
                    found.update(f"{where}:{name}" for name in node.names)
    return found


def test_every_per_process_state_of_ptdp_is_known_to_be_safe_in_the_pool():
    found = _process_state()
    unknown = found - KNOWN.keys()
    assert not unknown, (f"module-level state that a run mutates: {sorted(unknown)}; can a later run in the same "
                         "process see it? reset it in helpers._forget_earlier_runs, or keep such runs out of the "
                         "pool, then add it to KNOWN with the reason")
    assert found >= {"checkpointing/storage.py:_VERIFIED", "parallel/tensor/random.py:_TRACKER"}, (
        "the scan finds nothing: it could not fail")


def test_a_run_in_the_pool_after_others_is_a_fresh_process(tmp_path):
    """A pooled one-process run, after runs of another model, optimizer and schedule in the same ranks, logs
    what ``python -m ptdp train`` in a new process logs, bit for bit."""
    for other in (["--num-layers", "2", "--optimizer", "sgd"], ["--seed", "7", "--recompute-granularity", "full"]):
        train_metrics(tmp_path / "other", 1, other)
    flags = ["--seed", "11"]
    pooled = train_metrics(tmp_path / "pooled", 1, flags)
    fresh = tmp_path / "fresh.jsonl"
    run_ptdp(["train", *TINY, *flags, "--metrics-file", str(fresh)])
    assert track(pooled) == track([json.loads(line) for line in fresh.read_text().splitlines()])
