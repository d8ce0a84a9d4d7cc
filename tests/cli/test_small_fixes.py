"""Smaller fixes to resilience and configuration: the fp16 LR schedule does not advance on a skipped iteration, ``ptdp.config``
does not import ``ptdp.checkpointing``, every error is one newline-terminated line, a corrupt
``model.safetensors`` is one line, and a warm-up longer than the decay is refused."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import TINY, run_ptdp, train_metrics

from ptdp.config import OptimizerConfig
from ptdp.optim import learning_rate
from ptdp.runtime.errors import error_line


def one_error_line(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.endswith("\n"), repr(proc.stderr[-200:])
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def test_fp16_skipped_iteration_does_not_advance_the_lr_schedule(tmp_path):
    """Megatron steps its scheduler only after a successful update: the LR of an iteration is the schedule
    at (iteration - iterations skipped before it)."""
    records = train_metrics(tmp_path, 1, ["--fp16", "--initial-loss-scale", str(2**20), "--hysteresis", "1",
                                          "--train-iters", "6", "--lr-warmup-iters", "3"])
    cfg = OptimizerConfig(lr=1e-3, lr_warmup_iters=3)
    skipped_before = 0
    for r in records:
        assert r["lr"] == pytest.approx(learning_rate(r["iteration"] - skipped_before, cfg, 6), rel=1e-12)
        skipped_before = r["skipped_iterations"]
    assert records[0]["skipped_iterations"] >= 1 and records[1]["lr"] == records[0]["lr"]  # held, not advanced
    assert records[-1]["skipped_iterations"] < len(records)  # some steps happened after the skips


def test_config_does_not_import_checkpointing():
    code = "import sys, ptdp.config; print(sorted(m for m in sys.modules if m.startswith('ptdp.checkpointing')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_error_line_is_one_line_ending_with_a_newline():
    assert error_line(None, "bad\n  thing\n") == "ptdp: error: bad; thing\n"
    assert error_line("import", "x") == "ptdp import: error: x\n"


def test_bad_config_file_error_ends_with_a_newline(tmp_path):
    bad = tmp_path / "run.toml"
    bad.write_text("num-layers = [\n")
    one_error_line(run_ptdp(["train", "--config", str(bad)], check=False, timeout=60), "--config", str(bad))


def test_warmup_longer_than_decay_is_refused():
    proc = run_ptdp(["train", *TINY, "--lr-warmup-iters", "5", "--lr-decay-iters", "3"], check=False, timeout=60)
    one_error_line(proc, "--lr-warmup-iters 5", "--lr-decay-iters 3")


@pytest.mark.parametrize("content", [b"", b"\x00" * 7, b"{not a header", b"\xff" * 64],
                         ids=["empty", "short", "garbage", "huge-header-length"])
def test_import_of_a_corrupt_safetensors_is_one_line(tmp_path, content):
    pytest.importorskip("safetensors")
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2,
                                                 "n_positions": 16, "vocab_size": 50}))
    (src / "model.safetensors").write_bytes(content)
    proc = run_ptdp(["import", "--format", "hf", "--in", str(src), "--save", str(tmp_path / "ckpt")],
                    check=False, timeout=60)
    one_error_line(proc, "model.safetensors", "corrupted or truncated")
    assert not (tmp_path / "ckpt").exists()  # nothing half-written
