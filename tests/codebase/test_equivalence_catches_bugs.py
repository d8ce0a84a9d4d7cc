"""The equivalence helpers catch scaling bugs that a comparison of losses alone lets through.

Each bug is injected from outside ptdp by tests/faults/sitecustomize.py (``PTDP_TEST_BUG``), in the
spawned ranks only:

- ``dp-sum``: the data-parallel gradients are summed instead of averaged (a wrong 1/d factor). The
  gradient is clipped to norm 1 and Adam is invariant to its scale, so the model trains the same and the
  losses agree to fp32 tolerance: only the gradient norm (d times too large) shows the bug.
- ``tp-grad``: the backward of the tensor-parallel ``f`` operator skips its all-reduce, so the input
  gradient of every column-parallel layer misses the other rank's share.

The control is every other equivalence test: the reference runs with the same sitecustomize on its path.
"""

from __future__ import annotations

import pytest
from helpers import assert_same_run, assert_same_weights, train_run

RTOL = 1e-4


def test_a_wrong_data_parallel_averaging_factor_is_caught(tmp_path, reference):
    got = train_run(tmp_path, 2, [], env={"PTDP_TEST_BUG": "dp-sum"})
    assert got.losses == pytest.approx(reference.losses, rel=RTOL)  # losses alone would pass
    assert [r["grad_norm"] for r in got.records] == pytest.approx([2 * r["grad_norm"] for r in reference.records],
                                                                 rel=RTOL)  # the bug really ran: d = 2 times
    with pytest.raises(AssertionError, match="grad_norm"):
        assert_same_run(got, reference, RTOL)


def test_a_gradient_missing_its_tensor_parallel_reduction_is_caught(tmp_path, reference):
    got = train_run(tmp_path, 2, ["--tensor-model-parallel-size", "2"], env={"PTDP_TEST_BUG": "tp-grad"})
    with pytest.raises(AssertionError, match="grad_norm"):
        assert_same_run(got, reference, RTOL)
    with pytest.raises(AssertionError):
        assert_same_weights(got, reference)

