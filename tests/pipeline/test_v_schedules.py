"""The zero-bubble and V-shaped schedules train the same model as one process (losses, gradient norms, weights).

zbv, v-half and v-min place each rank's two chunks in a V (rank r holds virtual stages r and 2p-1-r), so
the first and last stage, and the two copies of the tied embedding, share rank 0; zb-h2 keeps one chunk
per rank and runs up to 2p-1 microbatches ahead. Every list passes the NCCL model (test_nccl_model.py).
"""

from __future__ import annotations

import pytest
from helpers import TINY, assert_equivalent, assert_same_run, run_layouts

RTOL = 1e-4
EIGHT = [*TINY, "--num-layers", "8"]
SIX = [*EIGHT, "--train-iters", "6"]


def _layout(t: int, p: int, schedule: str) -> list[str]:
    return ["--tensor-model-parallel-size", str(t), "--pipeline-model-parallel-size", str(p),
            "--pipeline-schedule", schedule]


LAYOUTS = {
    "zbv-p2d2-distopt-selective": (4, [*_layout(1, 2, "zbv"), "--use-distributed-optimizer",
                                       "--recompute-granularity", "selective"]),
    "zbv-t2p4-sp": (8, [*_layout(2, 4, "zbv"), "--sequence-parallel"]),
    "zb-h2-p4-selective": (4, [*_layout(1, 4, "zb-h2"), "--recompute-granularity", "selective"]),
    "v-half-p4-selective": (4, [*_layout(1, 4, "v-half"), "--recompute-granularity", "selective"]),
    "v-min-p4-full": (4, [*_layout(1, 4, "v-min"), "--recompute-granularity", "full"]),
}
# A zbv checkpoint (rank 0 holds layers 0, 1, 6 and 7) resumes in interleaved and 1f1b layouts, and a 1f1b
# checkpoint resumes in a V, all at the uninterrupted run's iterations 4 to 6.
RESHARDS = {  # saver: (world, layout), [(loader, world, layout)]
    "zbv": ((2, _layout(1, 2, "zbv")),
            [("interleaved", 2, [*_layout(1, 2, "interleaved"), "--virtual-pipeline-model-parallel-size", "2"]),
             ("1f1b-distopt", 4, [*_layout(1, 2, "1f1b"), "--use-distributed-optimizer"])]),
    "1f1b": ((2, _layout(1, 2, "1f1b")), [("v-half", 2, _layout(1, 2, "v-half"))]),
}


def plan(tmp) -> dict:
    out = {name: (n, [*EIGHT, *flags]) for name, (n, flags) in LAYOUTS.items()}
    out["six-one-process"] = (1, SIX)
    for saver, ((n, flags), loaders) in RESHARDS.items():
        ckpt = str(tmp / f"{saver}-save")
        out[f"{saver}-save"] = (n, [*SIX, *flags, "--save", ckpt, "--exit-interval", "3"])
        for loader, m, layout in loaders:
            out[f"{saver}-to-{loader}"] = (m, [*SIX, *layout, "--load", ckpt])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("v")
    return run_layouts(tmp, plan(tmp), base=[])


@pytest.mark.parametrize("name", LAYOUTS)
def test_zero_bubble_layouts_match_single_process(runs, reference_8_layers, name):
    assert_equivalent(runs[name], reference_8_layers, RTOL)
    assert runs[name].records[-1]["bubble_fraction_formula"] > 0


@pytest.mark.parametrize("saver", RESHARDS)
def test_checkpoints_reshard_between_v_and_loop_placements(runs, saver):
    reference = runs["six-one-process"]
    first = runs[f"{saver}-save"]
    assert [r["iteration"] for r in first.records] == [1, 2, 3]
    assert_same_run(first, reference, RTOL)
    for loader, _, _ in RESHARDS[saver][1]:
        resumed = runs[f"{saver}-to-{loader}"]
        assert [r["iteration"] for r in resumed.records] == [4, 5, 6]
        assert_equivalent(resumed, reference, RTOL)
