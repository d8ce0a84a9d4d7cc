"""``ptdp simulate --enable-vocab-parallel``: the executor's vocabulary-parallel lists through time.
Every rank runs its S, T, EF and EB, each pass starts only after the collective it consumes, the per-rank
busy time is even where the baseline's is not, a small case by hand, the picture and the CLI."""

from __future__ import annotations

import argparse
import json

import pytest

from ptdp.planner.vocab import vocab_pass_times
from ptdp.schedule.registry import REGISTRY, build_schedule
from ptdp.schedule.vocab import end_ranks
from ptdp.simulate.command import add_simulate_arguments, draw, run_simulate
from ptdp.simulate.vocab import simulate_vocab

LARGE = ["--pipeline-model-parallel-size", "4", "--num-layers", "8", "--embedding-cost", "1",
         "--output-layer-cost", "6", "--num-microbatches", "8"]  # V ~ 64k at h = 256: the loss costs 6 layers


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    return run_simulate(parser.parse_args(list(argv)))


def test_pass_times_split_the_output_layer_as_the_stage_runs_it():
    one, two = (vocab_pass_times((1.0, 2.0), (3.0, 6.0), 4, 8, b) for b in (1, 2))
    assert two == {"EF": 2.0, "EB": 4.0, "S": 0.75, "T": 1.5}
    assert one == {"EF": 2.0, "EB": 4.0, "S": 1.5, "T": 0.75}  # exp(z - max) W moves into S


@pytest.mark.parametrize("barriers", [1, 2])
def test_two_ranks_one_microbatch_by_hand(barriers):
    # F0 [0,1] on rank 0, [1,2] on rank 1; BCAST_H done at 2; S, C0, T on both; the last stage's B then
    # rank 0's B; S + T = 3 either way (one barrier: S 2, T 1; two: S 1, T 2)
    times = vocab_pass_times((0.0, 0.0), (2.0, 4.0), 2, 1, barriers)
    result = simulate_vocab("1f1b", 2, 1, 1, barriers, times)
    s, t = times["S"], times["T"]
    assert result.total_time == pytest.approx(2 + s + t + 4)
    for r in range(2):
        row = {b.op: (b.start, b.end) for b in result.timelines[r] if b.op in ("S", "T", "B")}
        assert row["S"] == pytest.approx((2, 2 + s)) and row["T"] == pytest.approx((2 + s, 2 + s + t))
    assert [b.start for b in result.timelines[1] if b.op == "B"] == pytest.approx([2 + s + t])
    assert [op for op, _, _ in result.collectives].count("C1") == (barriers == 2)


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "v-half", "zbv", "zb-h1"])
@pytest.mark.parametrize("barriers", [1, 2])
def test_every_rank_runs_its_passes_after_their_collectives(name, barriers):
    p, m, c = 4, 8, 0.25
    v = REGISTRY[name].chunks or (2 if name == "interleaved" else 1)
    times = vocab_pass_times((0.5, 1.0), (1.5, 3.0), p, m, barriers)
    result = simulate_vocab(name, p, v, m, barriers, times, p2p_time=c)
    done = {(op, mb): t for op, mb, t in result.collectives}
    _, last_rank, last = end_ranks(p, v, REGISTRY[name].placement)
    last_chunk = last // p if REGISTRY[name].placement == "loop" else 1
    for r, row in enumerate(result.timelines):
        ops = [b.op for b in row]
        assert ops.count("EF") == ops.count("EB") == 1 and ops.count("S") == ops.count("T") == m, (r, ops)
        for b in row:
            needs = {"S": ("BCAST_H", b.microbatch), "T": ("C0", b.microbatch), "EB": ("EMB_G", 0)}.get(b.op)
            if needs:
                assert b.start >= done[needs] - 1e-9, (r, b)
        lists = build_schedule(name, p, v, m, r, vocab_barriers=barriers)
        assert [(b.op, b.microbatch) for b in row] == [(a.op, a.microbatch) for a in lists
                                                       if a.op in ("F", "B", "I", "W", "EF", "EB", "S", "T")]
    for b in result.timelines[last_rank]:
        if b.op in ("B", "I") and b.chunk == last_chunk:
            t_end = max(x.end for row in result.timelines for x in row if x.op == "T" and x.microbatch == b.microbatch)
            own_t = next(x.end for x in result.timelines[last_rank] if x.op == "T" and x.microbatch == b.microbatch)
            assert b.start >= (done["C1", b.microbatch] if barriers == 2 else own_t) - 1e-9
            assert barriers == 1 or b.start >= t_end + c - 1e-9
    assert result.busy == pytest.approx([result.busy[0]] * p)  # every rank: its layers and 1/p of the vocabulary


def test_cli_draws_s_and_t_and_balances_the_busy_time_at_a_large_vocabulary(capsys, tmp_path):
    assert _cli(*LARGE, "--json") == 0
    baseline = json.loads(capsys.readouterr().out)
    busy = [sum(b[4] - b[3] for b in row) for row in baseline["timelines"]]
    assert max(busy) / sorted(busy)[2] > 2.5  # the last stage holds the output layer and the loss
    for barriers in (1, 2):
        out = tmp_path / f"vp{barriers}.png"
        flags = ["--enable-vocab-parallel"] + ["--disable-fb-fusion"] * (barriers == 2)
        assert _cli(*LARGE, *flags, "--out", str(out)) == 0
        text = capsys.readouterr().out
        assert "busy time per rank: 45.000 45.000 45.000 45.000; slowest / median 1.00" in text
        s, t = (1.5, 0.75) if barriers == 1 else (0.75, 1.5)  # per microbatch on a rank: 6 layers · 1.5 / 4
        assert f"S per rank [{8 * s:g}, {8 * s:g}, {8 * s:g}, {8 * s:g}], T per rank [{8 * t:g}" in text
        assert out.read_bytes().startswith(b"\x89PNG")
        assert _cli(*LARGE, *flags, "--json") == 0
        got = json.loads(capsys.readouterr().out)
        assert got["total_time"] < baseline["total_time"]
        assert {op for row in got["timelines"] for op, *_ in row} == {"F", "B", "EF", "S", "T", "EB"}
        assert got["vocab_pass_time"]["S"] == [8 * s] * 4 and got["vocab_barriers"] == barriers
        assert sum(op == "C1" for op, *_ in got["collectives"]) == (8 if barriers == 2 else 0)


def test_draw_svg_names_the_passes(tmp_path):
    result = simulate_vocab("interleaved", 4, 2, 8, 1, vocab_pass_times((0.5, 1.0), (1.5, 3.0), 4, 8, 1))
    draw(result, tmp_path / "vp.svg")
    svg = (tmp_path / "vp.svg").read_text()
    assert "S: logits, max, sum exp" in svg and "T: loss and logit grad" in svg and "barrier" in svg


@pytest.mark.parametrize("argv, first_words", [
    (["--enable-vocab-parallel"], "--enable-vocab-parallel needs --num-layers"),
    (["--enable-vocab-parallel", "--pipeline-model-parallel-size", "1", "--num-layers", "4"],
     "--enable-vocab-parallel needs --pipeline-model-parallel-size > 1"),
    (["--disable-fb-fusion"], "--disable-fb-fusion needs --enable-vocab-parallel"),
])
def test_bad_vocab_flags_are_one_line_exit_2(capsys, argv, first_words):
    assert _cli(*argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"ptdp simulate: error: {first_words}"), err


def test_comm_trace_checks_the_vocabulary_lists(capsys, tmp_path):
    trace = tmp_path / "t.json"
    assert _cli("--pipeline-schedule", "v-half", "--enable-vocab-parallel", "--disable-fb-fusion",
                "--comm-trace", str(trace)) == 0
    assert "deadlock-free" in capsys.readouterr().out
    assert any(e.get("op") == "C1" or "C1" in json.dumps(e) for r in json.loads(trace.read_text())["ranks"] for e in r)


def test_plan_prints_the_simulate_command_of_its_layout(capsys):
    """``ptdp plan`` ends with the ``ptdp simulate`` line that draws its choice, the vocabulary layers
    priced as the plan prices them (``planner.vocab.vocab_costs``, in transformer layers)."""
    import shlex

    from ptdp.cli.main import main

    shape = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "1024",
             "--vocab-size", "65536", "--global-batch-size", "16", "--gpus", "4", "--gpus-per-node", "4",
             "--micro-batch-size", "1", "--pipeline-model-parallel-size", "4", "--tensor-model-parallel-size", "1"]
    for extra in (["--enable-vocab-parallel"], []):
        assert main(["plan", *shape, *extra]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("picture: "))
        argv = shlex.split(line.removeprefix("picture: ptdp simulate "))
        cost = float(argv[argv.index("--output-layer-cost") + 1])
        assert cost > 5  # V = 64k at h = 256: the output layer and the loss outweigh several layers
        assert ("--enable-vocab-parallel" in argv) == bool(extra)
        assert _cli(*argv[:argv.index("--out")], "--json") == 0
        got = json.loads(capsys.readouterr().out)
        busy = [sum(b[4] - b[3] for b in row) for row in got["timelines"]]
        assert (max(busy) / min(busy) < 1.01) == bool(extra)
