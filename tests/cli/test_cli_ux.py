"""What a new user meets first: ``ptdp simulate --out`` after ``pip install -e .`` (no
matplotlib), "did you mean" for a mistyped command, ``--help`` texts, ``generate --load`` of a directory
that does not exist, and the pipeline metrics' bubble fraction within [0, 1]. In-process, fast."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from ptdp.cli.main import main


def _run(argv, capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


SIMULATE = ["simulate", "--pipeline-schedule", "interleaved", "--pipeline-model-parallel-size", "4",
            "--virtual-pipeline-model-parallel-size", "2", "--num-microbatches", "8"]


def test_simulate_writes_svg_without_matplotlib_and_png_is_one_line(tmp_path, capsys, monkeypatch):
    """The README's picture needs nothing beyond ``pip install -e .``; a PNG without matplotlib is one line,
    exit 2, naming the SVG that would work."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code, out, err = _run([*SIMULATE, "--out", str(tmp_path / "schedule.svg")], capsys)
    assert code == 0 and err == "" and "wrote" in out
    svg = (tmp_path / "schedule.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<rect") >= 4 * 2 * 8 * 2 + 1  # every F and B box, the page
    assert "interleaved: p=4, v=2, m=8" in svg and "forward, chunk 1" in svg
    code, out, err = _run([*SIMULATE, "--out", str(tmp_path / "schedule.png")], capsys)
    assert code == 2 and out == "" and not (tmp_path / "schedule.png").exists()
    assert err.count("\n") == 1 and "pip install 'ptdp[plot]'" in err and "schedule.svg needs nothing" in err, err


def test_simulate_vocab_svg_draws_the_passes_and_barriers(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = _run(["simulate", "--pipeline-model-parallel-size", "4", "--num-layers", "8", "--embedding-cost",
                         "1", "--output-layer-cost", "6", "--num-microbatches", "8", "--enable-vocab-parallel",
                         "--out", str(tmp_path / "vocab.svg")], capsys)
    svg = (tmp_path / "vocab.svg").read_text()
    assert code == 0 and err == ""
    assert "S: logits, max, sum exp" in svg and "barrier (C0/C1) done" in svg and "stroke-dasharray" in svg


@pytest.mark.parametrize("argv, suggestion", [(["trian"], "did you mean train?"),
                                              (["plna", "--gpus", "8"], "did you mean plan?"),
                                              (["train", "--pipeline-schedule", "1fb1"], "did you mean 1f1b?")])
def test_did_you_mean_for_commands_and_choices(argv, suggestion, capsys):
    code, out, err = _run(argv, capsys)
    assert code == 2 and out == "" and err.count("\n") == 1 and err.rstrip().endswith(suggestion), err


def test_help_names_every_format(capsys):
    code, out, _ = _run(["--help"], capsys)
    assert code == 0
    text = " ".join(out.split())
    assert "GPT-2, Llama, Mixtral or Qwen2-MoE" in text and "gpt2, llama, mixtral or qwen2_moe" in text
    assert "JSONL, Parquet, Arrow or saved Hugging Face datasets" in text and "GPT-2 model" not in text


def test_generate_load_of_a_missing_directory_says_so(tmp_path, capsys):
    code, out, err = _run(["generate", "--load", str(tmp_path / "missing-dir"), "--prompt", "x"], capsys)
    assert (code, out) == (2, "")
    assert err == f"ptdp generate: error: --load: {tmp_path / 'missing-dir'} does not exist\n"
    (tmp_path / "empty").mkdir()
    code, _, err = _run(["generate", "--load", str(tmp_path / "empty"), "--prompt", "x"], capsys)
    assert code == 2 and "holds no checkpoint yet" in err


@pytest.mark.parametrize("idle, busy", [(1.059, 1.0), (0.0, 2.0), (3.0, 0.0), (0.5, 1.5)])
def test_bubble_fraction_is_a_fraction(idle, busy):
    """Idle over the schedule's time: within [0, 1] however long the waits (the first iteration's made the
    old idle / busy 1.059); the formula is the same fraction of the paper's idle over ideal time."""
    from ptdp.train.report import pipeline_metrics

    plan = SimpleNamespace(world=1, p=4, m=2, schedule="1f1b", overlap_moe_expert_parallel_comm=False)
    trainer = SimpleNamespace(plan=plan, chunks=[0])
    stats = SimpleNamespace(idle_s=idle, busy_s=busy, peak_in_flight=2, peak_saved_bytes=10)
    got = pipeline_metrics(trainer, stats)
    assert 0 <= got["bubble_fraction"] <= 1
    assert got["bubble_fraction"] == pytest.approx(idle / (idle + busy) if idle + busy else 0)
    assert got["bubble_fraction_formula"] == pytest.approx(1.5 / 2.5)  # (p-1)/m = 3/2 > 1: the paper's ratio
