"""Checkpoints written by earlier versions keep loading and continue the same run.

``fixtures/checkpoint_v0`` was written at iteration 2 by ptdp as it stood before the architecture rework
(commit 0bacbe4): a 2-layer GPT (h = 16) at t = 2, d = 2 with ZeRO-3 (``optim_grads_params``), 4 processes.
``expected.json`` holds that version's losses and gradient norms for the uninterrupted run and for the
continuations from this checkpoint, in the same layout and in one process. Today's code must continue it
the same way: a renamed state-dict key, a changed shard layout or a lost optimizer state moves the losses by
far more than the tolerance (which only absorbs a different CPU's summation order).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from helpers import TINY, run_layouts

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint_v0"
Z3 = ["--data-parallel-sharding-strategy", "optim_grads_params", "--tensor-model-parallel-size", "2"]


def small() -> list[str]:
    base = list(TINY)
    for flag, value in (("--num-layers", "2"), ("--hidden-size", "16"), ("--num-attention-heads", "2"),
                        ("--global-batch-size", "16")):  # the recorded run's batch
        base[base.index(flag) + 1] = value
    return base + ["--train-iters", "4"]


def move_default_corpus(directory: Path) -> None:
    """The checkpoint names its data by absolute prefix (docs/data.md: a prefix that is not in the blend any
    more is a dropped dataset). The fixture read the default corpus from the recording machine's cache; point
    it at this session's copy of the same corpus, as a user who moved their data would, and re-seal it."""
    from ptdp.data import default_corpus_prefix
    from ptdp.data.mix_state import dataset_identity

    info_file = directory / "ptdp.json"
    info = json.loads(info_file.read_text())
    prefix = default_corpus_prefix()
    (dataset,) = info["data"]["datasets"]
    now = dataset_identity(prefix)
    if any(now[k] != dataset[k] for k in ("idx_bytes", "bin_bytes", "idx_sha256")):
        pytest.skip("this machine's default corpus (built from its Python's standard library) is not the "
                    "one the fixture was trained on")
    dataset["prefix"] = prefix
    info_file.write_text(json.dumps(info))
    sums = directory / "checksums.sha256"
    digest = hashlib.sha256(info_file.read_bytes()).hexdigest()
    sums.write_text("".join(f"{digest}  ptdp.json\n" if line.endswith("  ptdp.json") else f"{line}\n"
                            for line in sums.read_text().splitlines()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compat")
    ckpt = tmp / "ckpt"
    shutil.copytree(FIXTURE, ckpt, ignore=shutil.ignore_patterns("expected.json"))
    move_default_corpus(ckpt / "iter_0000002")
    plan = {"same-resume": (4, [*Z3, "--load", str(ckpt)]), "one-resume": (1, ["--load", str(ckpt)])}
    return run_layouts(tmp / "runs", plan, base=small(), save=False)  # records only: no final save


@pytest.mark.parametrize("name", ["same-resume", "one-resume"])
def test_an_old_checkpoint_continues_the_same_run(runs, name):
    expected = json.loads((FIXTURE / "expected.json").read_text())
    got = [(r["iteration"], r["loss"], r["grad_norm"]) for r in runs[name].records]
    want = expected[name]
    assert [it for it, _, _ in got] == [it for it, _, _ in want] == [3, 4]
    for (_, loss, norm), (_, loss0, norm0) in zip(got, want, strict=True):
        assert loss == pytest.approx(loss0, rel=1e-5) and norm == pytest.approx(norm0, rel=1e-5)
    # and it is the run that never stopped (the checkpoint held everything: weights, Adam, data position)
    for (_, loss, _), (_, loss0, _) in zip(got, expected["uninterrupted"][2:], strict=True):
        assert loss == pytest.approx(loss0, rel=1e-5)
