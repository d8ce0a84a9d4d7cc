"""Vocabulary parallelism across pipeline stages (issue 24): equivalence with one process, the schedules'
NCCL safety with the S/T passes and their collectives, and the flags' errors."""

from __future__ import annotations

import pytest
from helpers import TINY, assert_equivalent, run_layouts, train_run

VP = ["--enable-vocab-parallel"]
P4 = ["--pipeline-model-parallel-size", "4"]
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights"]


@pytest.fixture(scope="module")
def gpt_runs(tmp_path_factory):
    """GPT (tied), one spawn: p=4 1f1b with one and two barriers, (t,p,d)=(2,2,2) interleaved, p=4 v-half."""
    return run_layouts(tmp_path_factory.mktemp("vocab-gpt"), {
        "1f1b-1": (4, [*P4, *VP]),
        "1f1b-2": (4, [*P4, *VP, "--disable-fb-fusion"]),
        "interleaved-222": (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                "--virtual-pipeline-model-parallel-size", "2", "--pipeline-schedule",
                                "interleaved", *VP]),
        "v-half": (4, [*P4, "--pipeline-schedule", "v-half", *VP, "--num-layers", "8"]),
    })


@pytest.mark.parametrize("name", ["1f1b-1", "1f1b-2", "interleaved-222"])
def test_gpt_tied_matches_one_process(gpt_runs, reference, name):
    assert_equivalent(gpt_runs[name], reference)


def test_gpt_v_half_matches_one_process(gpt_runs, reference_8_layers):
    assert_equivalent(gpt_runs["v-half"], reference_8_layers)
