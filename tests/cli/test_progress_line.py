"""The progress line's "lm loss" is Megatron-LM's: the mean over the iterations since the last printed line
(fp16-skipped iterations left out), while --metrics-file keeps each iteration's own loss."""

from __future__ import annotations

import json
import re

import pytest
from helpers import TINY, run_ptdp

from ptdp.train.report import interval_loss, progress_line


def test_interval_loss_is_the_mean_over_the_iterations_that_updated_the_weights():
    records = [{"loss": 4.0, "skipped_iterations": 0}, {"loss": 100.0, "skipped_iterations": 1},
               {"loss": 2.0, "skipped_iterations": 1}]
    assert interval_loss(records, skipped_before=0) == pytest.approx(3.0)  # the skipped 100 left out
    assert interval_loss([{"loss": 5.0}, {"loss": 7.0}], skipped_before=0) == pytest.approx(6.0)
    assert interval_loss([{"loss": 5.0, "skipped_iterations": 3}], skipped_before=2) == 5.0  # all skipped


def test_progress_line_shows_the_loss_it_is_given():
    record = {"iteration": 2, "consumed_samples": 32, "iteration_time_s": 0.1, "lr": 1e-3, "loss": 9.0,
              "grad_norm": 1.0, "tokens_per_s": 10.0, "tflops_per_gpu": 0.0}
    assert "| lm loss: 5.000000E+00 |" in progress_line(record, 4, 1.0, loss=5.0)
    assert "| lm loss: 9.000000E+00 |" in progress_line(record, 4, 1.0)


def test_printed_lm_loss_is_the_mean_of_the_log_interval(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    proc = run_ptdp(["train", *TINY, "--train-iters", "5", "--log-interval", "2", "--metrics-file", str(metrics)])
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses) == 5  # the metrics file stays per iteration
    printed = {int(m[1]): float(m[2]) for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ .*?\| lm loss: (\S+) \|",
                                                            proc.stdout)}
    assert sorted(printed) == [2, 4, 5]
    for it, interval in ((2, losses[0:2]), (4, losses[2:4]), (5, losses[4:5])):
        assert printed[it] == pytest.approx(sum(interval) / len(interval), rel=1e-6)
    assert printed[2] != pytest.approx(losses[1], rel=1e-9)  # not the last iteration's
