"""--timeline, --tensorboard-dir and the run summary, read back from a real 4-process pipeline run."""

from __future__ import annotations

import contextlib
import json
from collections import Counter

import pytest
from helpers import GLOBAL_BATCH, MICRO_BATCH, TINY, _run_layouts, pooled_spawn

from ptdp.cli.main import main as ptdp_main
from ptdp.observability.timeline import MERGED

P, D, V, ITERS, TIMELINE_ITERS = 2, 2, 2, 3, 2
M = GLOBAL_BATCH // (MICRO_BATCH * D)  # microbatches per pipeline: B / (b * d)


def _train_printing_to(rank: int, world_size: int, root: str, plan: list) -> None:
    """``helpers._run_layouts`` with each rank's standard output in ``root/stdout-rank{rank}.txt``."""
    with open(f"{root}/stdout-rank{rank}.txt", "w") as out, contextlib.redirect_stdout(out):
        _run_layouts(rank, world_size, root, plan)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run, as ``ptdp train --nproc-per-node 4`` would make it, in 4 ranks of the session's pool (the
    same ``train()``, without starting Python and torch in a launcher and 4 workers)."""
    root = tmp_path_factory.mktemp("observed")
    argv = [*TINY, "--pipeline-model-parallel-size", str(P), "--virtual-pipeline-model-parallel-size", str(V),
            "--train-iters", str(ITERS), "--timeline", str(root / "tl"), "--timeline-iters", str(TIMELINE_ITERS),
            "--tensorboard-dir", str(root / "tb"), "--metrics-file", str(root / "metrics.jsonl"),
            "--save", str(root / "ckpt"), "--eval-interval", "3"]
    pooled_spawn(_train_printing_to, P * D, root, str(root), [("observed", P * D, argv)])
    records = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    return root, (root / "stdout-rank0.txt").read_text(), records


def complete_events(path):
    return [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]


def test_every_rank_traces_m_times_v_forwards_and_backwards_per_iteration(run):
    root, _, _ = run
    for rank in range(P * D):
        events = complete_events(root / "tl" / f"rank{rank}.json")
        assert {e["pid"] for e in events} == {rank}
        assert {e["args"]["iteration"] for e in events} == set(range(1, TIMELINE_ITERS + 1))
        counts = Counter((e["name"], e["args"]["iteration"]) for e in events)
        for it in range(1, TIMELINE_ITERS + 1):
            assert counts["forward", it] == counts["backward", it] == M * V
            for collective in ("dp_grad_all_reduce", "optimizer_step"):  # the step holds the grad norm
                assert counts[collective, it] == 1
        waits = [e for e in events if e["cat"] == "p2p"]
        assert waits and all(e["name"].startswith("wait_") for e in waits)
        pairs = {(e["args"]["microbatch"], e["args"]["chunk"]) for e in events if e["name"] == "forward"}
        assert pairs == {(j, c) for j in range(M) for c in range(V)}
        for tid in {e["tid"] for e in events}:  # one row never holds two events at once
            row = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["tid"] == tid)
            assert all(end <= nxt + 1e-3 for (_, end), (nxt, _) in zip(row, row[1:]))


def test_merged_timeline_is_all_ranks_on_one_clock(run):
    root, stdout, _ = run
    merged = complete_events(root / "tl" / MERGED)
    per_rank = [complete_events(root / "tl" / f"rank{r}.json") for r in range(P * D)]
    assert sorted(map(json.dumps, merged)) == sorted(json.dumps(e) for events in per_rank for e in events)
    # A virtual stage's forward of a microbatch starts after the previous stage's forward of it ended.
    forward = {}
    for e in merged:
        if e["name"] == "forward":
            pp_rank = e["pid"] // D  # rank = pp_rank * d * t + dp_rank * t + tp_rank, t = 1
            stage = e["args"]["chunk"] * P + pp_rank
            forward[e["args"]["iteration"], e["pid"] % D, e["args"]["microbatch"], stage] = e
    for (it, dp, mb, stage), e in forward.items():
        if stage > 0:
            before = forward[it, dp, mb, stage - 1]
            assert e["ts"] >= before["ts"] + before["dur"]
    assert f"timeline of iterations 1-{TIMELINE_ITERS}" in stdout


def test_timeline_merge_command_rebuilds_merged_json(run, capsys):
    root, _, _ = run
    expected = json.loads((root / "tl" / MERGED).read_text())
    (root / "tl" / MERGED).unlink()
    assert ptdp_main(["timeline", "merge", str(root / "tl")]) == 0
    assert json.loads((root / "tl" / MERGED).read_text()) == expected
    assert ptdp_main(["timeline", "merge", str(root / "empty")]) == 2
    assert len(capsys.readouterr().err.splitlines()) == 1


def test_tensorboard_scalars_are_the_metrics(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, _, records = run
    events = EventAccumulator(str(root / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/learning_rate", "train/grad_norm", "throughput/tokens_per_s",
            "throughput/tflops_per_gpu", "memory/peak_bytes"} <= tags
    loss = events.Scalars("train/loss")
    assert [s.step for s in loss] == [r["iteration"] for r in records]
    assert [s.value for s in loss] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    lrs = [s.value for s in events.Scalars("train/learning_rate")]
    assert lrs == pytest.approx([r["lr"] for r in records])
    (val,) = events.Scalars("val/loss")  # --eval-interval 3: evaluated once, at iteration 3
    assert (val.step, val.value) == (3, pytest.approx(records[-1]["val_loss"], rel=1e-6))


def test_final_summary_line(run):
    root, stdout, records = run
    (line,) = [x for x in stdout.splitlines() if "run summary" in x]
    assert f"iterations: {ITERS}" in line
    assert f"tokens seen: {ITERS * GLOBAL_BATCH * 16:,}" in line  # iterations x B x s
    assert f"final lm loss: {records[-1]['loss']:.6E}" in line
    assert f"checkpoint: {root / 'ckpt' / 'iter_0000003'}" in line
    assert "average TFLOP/s/GPU: " in line
    assert f"best val loss: {records[-1]['val_loss']:.6E}" in line


def test_best_validation_loss_in_summary():
    from ptdp.observability.summary import run_summary, summary_line

    records = [{"loss": 3.0, "val_loss": 2.5}, {"loss": 2.0}, {"loss": 1.5, "val_loss": 2.25}]
    summary = run_summary(records, wall_s=2.0, world_size=4, iteration_flops=8e12, tokens_per_iteration=100,
                          checkpoint=None)
    assert summary["best_val_loss"] == 2.25 and summary["tokens"] == 300
    assert summary["avg_tflops_per_gpu"] == pytest.approx(3 * 8 / 2 / 4)
    assert "best val loss: 2.250000E+00" in summary_line(summary)


@pytest.mark.parametrize("flags,message", [
    (["--timeline-iters", "0", "--timeline", "{tmp}/tl"],
     "--timeline-iters must be a positive integer, got 0"),
    (["--tensorboard-dir", "{tmp}/file"],
     "--tensorboard-dir {tmp}/file is not a directory (a file is in the way); choose a directory path"),
])
def test_bad_flags_are_one_line_errors(tmp_path, capsys, flags, message):
    (tmp_path / "file").write_text("")
    assert ptdp_main(["train", *TINY, *[f.format(tmp=tmp_path) for f in flags]]) == 2  # before any training
    assert capsys.readouterr().err.splitlines() == [f"ptdp train: error: {message.format(tmp=tmp_path)}"]
