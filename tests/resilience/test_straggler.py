"""The straggler report in the metrics, and a long evaluation under the hang watchdog.

Ranks are slowed on purpose by ``PTDP_TEST_SLOW_RANK=R:SECONDS`` (a sleep in each step of rank R, or of
every rank with ``*``, inside the schedule's compute time and in each validation batch), which
tests/faults/sitecustomize.py patches in from outside ptdp.
"""

from __future__ import annotations

from helpers import assert_same_run, train_metrics

KEYS = ("step_time_spread_s", "step_time_max_over_median", "slowest_rank")


def test_the_slow_rank_is_named_slowest(tmp_path):
    """One report per flushed window (here the 3 iterations at once), from one all-gather: the rank that
    sleeps 0.5 s per step in its compute time is the slowest (how much slower is timing, which a loaded
    machine skews: benchmarks measure it, this test does not)."""
    records = train_metrics(tmp_path, 2, ["--log-interval", "3"], env={"PTDP_TEST_SLOW_RANK": "1:0.5"})
    assert [r["iteration"] for r in records] == [1, 2, 3]
    report = records[-1]
    assert all(key in report for key in KEYS), report
    assert report["slowest_rank"] == 1
    assert report["step_time_spread_s"] > 0
    assert report["step_time_max_over_median"] > 1.0


def test_a_long_evaluation_is_not_a_hang(tmp_path, reference):
    """15 validation batches of 0.4 s each (6 s, three times --hang-timeout-s 2): each batch is progress,
    so the watchdog stays quiet (it would exit 3, failing the run), and training is the plain run's."""
    records = train_metrics(tmp_path, 2, ["--eval-interval", "3", "--eval-iters", "15", "--hang-timeout-s", "2"],
                            env={"PTDP_TEST_SLOW_RANK": "*:0.4"})
    assert "val_loss" in records[-1]
    assert_same_run(records, reference, 1e-4)
