"""Packed documents in every layout: with ``--reset-position-ids --reset-attention-mask
--eod-mask-loss`` on a corpus of short documents, each layout trains like one process -- the same loss and
gradient norm every iteration, the same weights at the end -- under Megatron's default loss normalisation
and under ``--calculate-per-token-loss``. One ``run_layouts`` call (one start of the ranks) for them all.
"""

from __future__ import annotations

import pytest
from helpers import TINY, assert_equivalent, run_layouts, short_documents

PACKED = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
PER_TOKEN = ["--calculate-per-token-loss"]
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]

PLAN = {  # name: (world size, flags); each compared with the one-process run of the same flags sans layout
    "plain": (1, []),
    "one": (1, PACKED),
    "t2_sp": (2, [*PACKED, "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "p2_zbv": (2, [*PACKED, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv"]),
    "c2_ring": (2, [*PACKED, "--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
    "c2_allgather": (2, [*PACKED, "--context-parallel-size", "2", "--cp-comm-type", "allgather"]),
    "c2_ulysses": (2, [*PACKED, "--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
    "zero3": (2, [*PACKED, "--data-parallel-sharding-strategy", "optim_grads_params"]),
    "recompute": (2, [*PACKED, "--context-parallel-size", "2", "--recompute-granularity", "full"]),
    "vocab": (2, [*PACKED, "--pipeline-model-parallel-size", "2", "--enable-vocab-parallel"]),
    "one_per_token": (1, [*PACKED, *PER_TOKEN]),
    "d2c2_per_token": (4, [*PACKED, *PER_TOKEN, "--context-parallel-size", "2"]),
    "p2d2_per_token_vocab": (4, [*PACKED, *PER_TOKEN, "--pipeline-model-parallel-size", "2",
                                 "--enable-vocab-parallel"]),
    "one_llama": (1, [*PACKED, *LLAMA]),
    "c2_ring_llama": (2, [*PACKED, *LLAMA, "--context-parallel-size", "2"]),
    "one_moe": (1, [*PACKED, *MOE]),
    "e2": (2, [*PACKED, *MOE, "--expert-model-parallel-size", "2"]),
}
REFERENCE = {"t2_sp": "one", "p2_zbv": "one", "c2_ring": "one", "c2_allgather": "one", "c2_ulysses": "one",
             "zero3": "one", "recompute": "one", "vocab": "one", "d2c2_per_token": "one_per_token",
             "p2d2_per_token_vocab": "one_per_token", "c2_ring_llama": "one_llama", "e2": "one_moe"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing")
    data = short_documents(root, 600)  # documents of 1 to 12 tokens: a few per 16-token sample
    return run_layouts(root / "runs", {name: (world, [*data, *flags]) for name, (world, flags) in PLAN.items()},
                       base=TINY)


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_layout_equals_one_process(runs, name):
    assert_equivalent(runs[name], runs[REFERENCE[name]])


def test_the_flags_and_the_normalisations_change_the_numbers(runs):
    """Controls: the packed run is not the plain one, and the two normalisations differ (the microbatches
    hold different numbers of unmasked tokens), so the comparisons above can fail."""
    plain, packed, per_token = (runs[n].losses for n in ("plain", "one", "one_per_token"))
    assert all(abs(a - b) > 1e-3 for a, b in zip(plain, packed))
    assert all(abs(a - b) > 1e-6 for a, b in zip(packed, per_token))
