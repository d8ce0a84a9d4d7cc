"""``ptdp simulate`` prices sliding-window layers by their window: min(w, s) keys per query, against FLOPs
worked out by hand."""

import argparse
import json

import pytest

from ptdp.simulate.command import add_simulate_arguments, run_simulate

# h = 64, a = 4 (q = k = 64), ffn = 4h = 256, s = 1024: per token the projections 2h(2q + 2k) = 32,768, the MLP
# 4·h·ffn = 65,536, the attention 4·s·q = 262,144 (whole context) or 4·w·q = 8,192 (w = 32)
SHAPE = ["--seq-length", "1024", "--hidden-size", "64", "--num-attention-heads", "4"]
RATIO = (32768 + 65536 + 8192) / (32768 + 65536 + 262144)


def _total(capsys, *argv: str) -> float:
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    assert run_simulate(parser.parse_args(["--pipeline-model-parallel-size", "2", "--num-microbatches", "4",
                                           "--num-layers", "8", "--json", *argv])) == 0
    return json.loads(capsys.readouterr().out)["total_time"]


def test_windowed_layers_cost_their_window(capsys):
    full = _total(capsys, *SHAPE)
    assert _total(capsys, *SHAPE, "--window-size", "32") == pytest.approx(RATIO * full, rel=1e-12)
    # every 4th layer global: each stage holds 3 sliding layers and 1 global one
    mixed = _total(capsys, *SHAPE, "--window-size", "32", "--window-attn-skip-freq", "4")
    assert mixed == pytest.approx((3 * RATIO + 1) / 4 * full, rel=1e-12)
    # a window as long as the sequence is the whole context
    assert _total(capsys, *SHAPE, "--window-size", "1024") == pytest.approx(full, rel=1e-12)


def test_uneven_windows_make_uneven_stages(capsys):
    # layers 0-3 slide, 4-7 are global: the second stage is the slowest, the first waits on nothing extra
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    args = parser.parse_args(["--pipeline-model-parallel-size", "2", "--num-microbatches", "4", "--num-layers",
                              "8", "--json", *SHAPE, "--window-size", "32", "--window-attn-skip-freq",
                              "[1]*4+[0]*4"])
    assert run_simulate(args) == 0
    timelines = json.loads(capsys.readouterr().out)["timelines"]
    busy = [sum(box[4] - box[3] for box in row) for row in timelines]
    assert busy[0] / busy[1] == pytest.approx(RATIO, rel=1e-12)


@pytest.mark.parametrize("argv, message", [
    (["--window-size", "32"], "--window-size needs --num-layers"),
    (["--num-layers", "8", "--window-attn-skip-freq", "2"], "--window-attn-skip-freq needs --window-size"),
    (["--num-layers", "8", "--window-size", "0"], "--window-size must be >= 1"),
    (["--num-layers", "8", "--window-size", "4", "--window-attn-skip-freq", "abc"], "--window-attn-skip-freq"),
])
def test_window_flags_refused_with_one_line(capsys, argv, message):
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    assert run_simulate(parser.parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
