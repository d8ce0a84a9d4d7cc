"""A training process starts without the modules it does not use (BENCHMARKS.md, "Process start-up").

Every ``ptdp train`` rank, every launcher and every test's worker paid for these at each start:
``torch._dynamo`` (through torch's optimizers' wrappers, ``ptdp.optim.eager``), ``torch.distributed.checkpoint``
with DTensor and sympy (until a save or a load needs them, ``ptdp.checkpointing.manager``), and the other
sub-commands' modules (``ptdp.cli.main``). An import that comes back cannot pass unnoticed: one process
trains, then builds and steps each optimizer kind a worker builds, and names what it imported.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ptdp

ROOT = Path(ptdp.__file__).parent.parent

# What a training process must not import to start: the heavy modules it does not use, and the other
# sub-commands of ``ptdp``. A save or a load imports torch.distributed.checkpoint (with DTensor and sympy);
# only ``torch.compile`` imports torch._dynamo.
DEFERRED = ("torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.tensor", "sympy", "transformers",
            "safetensors", "tokenizers", "ptdp.planner", "ptdp.simulate", "ptdp.hf", "ptdp.megatron",
            "ptdp.cli.generate", "ptdp.cli.samples", "ptdp.data.preprocess")

_TRAIN = ["train", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
          "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1", "--lr", "1e-3",
          "--hidden-dropout", "0", "--attention-dropout", "0"]

# What the process names: the deferred modules it imported.
_PROBE = f"import sys\nprint('IMPORTED', *(m for m in {DEFERRED!r} if m in sys.modules))\n"

# One process as a worker (and an importer of ``ptdp.checkpointing.full_model``), its garbage collector paused
# as the ``ptdp`` command pauses it: the command line's ``main`` trains (parser, checks, model, optimizer, steps), then
# each optimizer a worker may build (AdamW, SGD, Muon, and their host-offloaded forms) is built and stepped.
_WORKER = f"""
import sys
import ptdp.checkpointing.full_model  # generate's and the conversions' reader: imported, not yet used
from ptdp.cli.main import main
from ptdp.runtime import collector
collector.pause()  # as the ``ptdp`` command does first (ptdp/runtime/collector.py)
assert main({_TRAIN!r}) == 0
import gc
print("COLLECTING", gc.isenabled() and gc.get_freeze_count() > 0)  # resumed once the imports were done
import torch
from ptdp.config import OptimizerConfig
from ptdp.optim.optimizer import build_optimizer
for kind in ("adam", "sgd", "muon"):
    for offload in (False, True):
        params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
        optimizer = build_optimizer(params, OptimizerConfig(optimizer=kind, optimizer_cpu_offload=offload))
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
""" + _PROBE


def _run(code: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def _imported(lines: list[str]) -> list[str]:
    return next(s for s in lines if s.startswith("IMPORTED")).split()[1:]


def test_a_training_process_imports_none_of_the_deferred_modules():
    lines = _run(_WORKER)
    assert _imported(lines) == []
    assert "COLLECTING True" in lines  # the worker resumed the garbage collector after its imports


def test_the_check_sees_a_deferred_import():
    """The control: the same probe names the deferred modules a process did import."""
    assert _imported(_run("import torch.distributed.checkpoint\n" + _PROBE)) == [
        "torch.distributed.checkpoint", "torch.distributed.tensor", "sympy"]


@pytest.mark.parametrize("kind", ["AdamW", "AdamW-fused", "SGD"])
def test_the_eager_optimizers_step_exactly_as_torchs(kind):
    """``ptdp.optim.eager`` only skips torch's wrappers: the parameters and the state match torch's to the bit."""
    from ptdp.optim import eager

    name, _, fused = kind.partition("-")
    kwargs = {"lr": 1e-2, "momentum": 0.9} if name == "SGD" else {"lr": 1e-2, "fused": bool(fused) or None}
    runs = []
    for cls in (getattr(eager, name), getattr(torch.optim, name)):
        params = [torch.nn.Parameter(torch.randn(6, 3, generator=torch.Generator().manual_seed(i))) for i in range(2)]
        optimizer = cls([{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}],
                        **kwargs)
        for step in range(3):
            for i, p in enumerate(params):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i))
            optimizer.step()
        assert torch.is_grad_enabled()
        runs.append((params, optimizer.state))
    (got, got_state), (want, want_state) = runs
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x, y)
        assert got_state[x].keys() == want_state[y].keys()
        assert all(torch.equal(got_state[x][k], want_state[y][k]) for k in want_state[y])
