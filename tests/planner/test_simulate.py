"""The discrete-event schedule simulator: ideal bubbles, stash counts, p2p timing by hand, drawing, CLI."""

import argparse
import json

import pytest

from ptdp.schedule.actions import Action, peak_in_flight
from ptdp.schedule.registry import bubble_fraction_formula, build_schedule
from ptdp.simulate.command import add_simulate_arguments, draw, run_simulate, simulate

CASES = [
    ("gpipe", 2, 1, 4), ("gpipe", 4, 1, 8), ("1f1b", 4, 1, 8), ("1f1b", 4, 1, 3), ("1f1b", 8, 1, 16),
    ("interleaved", 4, 2, 8), ("interleaved", 4, 2, 4), ("interleaved", 4, 3, 12), ("interleaved", 2, 4, 6),
    ("interleaved", 8, 2, 16),
]


@pytest.mark.parametrize("name, p, v, m", CASES)
def test_ideal_bubble_matches_formula(name, p, v, m):
    # t_b = 2 t_f, free p2p: the paper's (p-1)/m and (p-1)/(v·m)
    result = simulate(name, p, v, m, forward_time=1.0, backward_time=2.0, p2p_time=0.0)
    assert result.bubble_fraction == pytest.approx((p - 1) / (v * m), rel=1e-9)
    assert result.bubble_fraction == pytest.approx(bubble_fraction_formula(p, v, m), rel=1e-9)
    # every rank does all its work: m·v chunks of (t_f + t_b)/v
    assert result.busy == pytest.approx([3.0 * m] * p)


@pytest.mark.parametrize("name, p, v, m", CASES + [("zb-h1", 4, 1, 8)])
def test_peak_in_flight_matches_schedules(name, p, v, m):
    result = simulate(name, p, v, m)
    assert result.peak_in_flight == [peak_in_flight(build_schedule(name, p, v, m, r)) for r in range(p)]


def test_gpipe_total_time_by_hand():
    # (m + p - 1)(t_f + t_b) = (8 + 3)·3
    assert simulate("gpipe", 4, 1, 8).total_time == pytest.approx(33.0)


def test_p2p_time_by_hand():
    # p=2, m=1: F on rank 0 [0,1], arrives 1+c, F on rank 1 [1+c, 2+c], B [2+c, 4+c], arrives 4+2c, B [4+2c, 6+2c]
    c = 0.25
    result = simulate("1f1b", 2, 1, 1, forward_time=1.0, backward_time=2.0, p2p_time=c)
    assert result.total_time == pytest.approx(6 + 2 * c)
    starts = [[b.start for b in row] for row in result.timelines]
    assert starts == [[0.0, 4 + 2 * c], [1 + c, 2 + c]]


def test_p2p_on_every_hop_by_hand():
    # p=3, m=1: forward chain 3·t_f + 2c, backward chain 3·t_b + 2c -> 9 + 4c; each rank busy 3
    c = 0.5
    result = simulate("gpipe", 3, 1, 1, p2p_time=c)
    assert result.total_time == pytest.approx(9 + 4 * c)
    assert [row[0].start for row in result.timelines] == pytest.approx([0.0, 1 + c, 2 + 2 * c])
    assert result.bubble_fraction == pytest.approx(3 * (9 + 4 * c - 3) / 9)


def test_deadlock_is_reported():
    lists = [[Action("RECV_B", 0, 0, 1), Action("B", 0, 0)], [Action("F", 0, 0)]]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(lists, 2, 1, 1)


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_draw_small_picture(tmp_path, suffix):
    out = tmp_path / f"interleaved{suffix}"
    draw(simulate("interleaved", 4, 2, 8), out)
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") if suffix == ".png" else b"<svg" in data[:2000]
    assert len(data) < 200_000


def _simulate_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    return run_simulate(parser.parse_args(list(argv)))


def test_cli_json(capsys, tmp_path):
    out = tmp_path / "s.png"
    assert _simulate_cli("--pipeline-schedule", "interleaved", "--pipeline-model-parallel-size", "4",
                         "--virtual-pipeline-model-parallel-size", "2", "--num-microbatches", "8",
                         "--out", str(out), "--json") == 0
    got = json.loads(capsys.readouterr().out)
    assert got["bubble_fraction"] == pytest.approx(3 / 16)
    assert got["peak_in_flight"] == [11, 9, 7, 5]
    assert out.exists()


@pytest.mark.parametrize("argv, flag", [
    (("--pipeline-schedule", "interleaved", "--virtual-pipeline-model-parallel-size", "2", "--num-microbatches",
      "6"), "--num-microbatches"),
    (("--pipeline-model-parallel-size", "0",), "--pipeline-model-parallel-size"),
    (("--virtual-pipeline-model-parallel-size", "2",), "--pipeline-schedule"),
    (("--p2p-time", "-1",), "--p2p-time"),
    (("--out", "x.txt",), "--out"),
    (("--num-layers", "0",), "--num-layers"),  # was a ZeroDivisionError traceback
])
def test_cli_bad_input(capsys, argv, flag):
    assert _simulate_cli(*argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err
