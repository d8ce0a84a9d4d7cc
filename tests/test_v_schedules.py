"""The zero-bubble and V-shaped schedules (issue 13) train the same model as one process.

zbv, v-half and v-min place each rank's two chunks in a V (rank r holds virtual stages r and 2p-1-r), so
the first and last stage, and the two copies of the tied embedding, share rank 0; zb-h2 keeps one chunk
per rank and runs up to 2p-1 microbatches ahead. Every list passes the NCCL model (test_nccl_model.py).
"""

from __future__ import annotations

import pytest
from helpers import losses, train_metrics

RTOL = 1e-4


@pytest.fixture(scope="module")
def reference_8_layers(tmp_path_factory):
    return losses(train_metrics(tmp_path_factory.mktemp("ref8"), 1, ["--num-layers", "8"]))


def _layout(t: int, p: int, schedule: str) -> list[str]:
    return ["--tensor-model-parallel-size", str(t), "--pipeline-model-parallel-size", str(p),
            "--pipeline-schedule", schedule]


@pytest.mark.parametrize("t,p,d,schedule,extra", [
    (1, 2, 2, "zbv", ["--use-distributed-optimizer", "--recompute-granularity", "selective"]),
    (2, 4, 1, "zbv", ["--sequence-parallel"]),
    (1, 4, 1, "zb-h2", ["--recompute-granularity", "selective"]),
    (1, 4, 1, "v-half", ["--recompute-granularity", "selective"]),
    (1, 4, 1, "v-min", ["--recompute-granularity", "full"]),
])
def test_zero_bubble_layouts_match_single_process(tmp_path, reference_8_layers, t, p, d, schedule, extra):
    records = train_metrics(tmp_path, t * p * d, ["--num-layers", "8", *_layout(t, p, schedule), *extra])
    assert losses(records) == pytest.approx(reference_8_layers, rel=RTOL)
    assert records[-1]["bubble_fraction_formula"] > 0


def test_checkpoints_reshard_between_v_and_loop_placements(tmp_path):
    """A zbv checkpoint (rank 0 holds layers 0, 1, 6 and 7) resumes in interleaved and 1f1b layouts, and a 1f1b
    checkpoint resumes in a V, all at the uninterrupted losses (iterations 4 to 6 of the reference)."""
    six = ["--num-layers", "8", "--train-iters", "6"]
    reference = losses(train_metrics(tmp_path / "ref6", 1, six))
    for saver, nproc, loaders in [
        (_layout(1, 2, "zbv"), 2, [(_layout(1, 2, "interleaved") + ["--virtual-pipeline-model-parallel-size", "2"], 2),
                                   (_layout(1, 2, "1f1b") + ["--use-distributed-optimizer"], 4)]),
        (_layout(1, 2, "1f1b"), 2, [(_layout(1, 2, "v-half"), 2)]),
    ]:
        ckpt = tmp_path / f"ckpt-{saver[-1]}"
        first = train_metrics(tmp_path / saver[-1], nproc, [*six, *saver, "--save", str(ckpt), "--exit-interval", "3"])
        assert losses(first) == pytest.approx(reference[:3], rel=RTOL)
        for layout, n in loaders:
            resumed = train_metrics(tmp_path / layout[5], n, [*six, *layout, "--load", str(ckpt)])
            assert [r["iteration"] for r in resumed] == [4, 5, 6]
            assert losses(resumed) == pytest.approx(reference[3:], rel=RTOL), (saver, layout)
