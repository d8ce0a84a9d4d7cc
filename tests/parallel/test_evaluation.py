"""Validation loss (``--eval-interval``/``--eval-iters``): every layout reports the single-process value,
and the single-process value is the dense mean loss of the saved model over the validation batches."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import TINY, run_layouts

from ptdp.checkpointing import read_full_model_state
from ptdp.data import build_datasets, get_microbatch
from ptdp.hf.convert import full_model_from_state
from ptdp.parallel.tensor import language_model_loss

EVAL = [*TINY, "--train-iters", "4", "--eval-interval", "2", "--eval-iters", "2"]  # later flags win
RTOL = 1e-4  # other layouts sum in another order: fp32 tolerance

LAYOUTS = {  # (t, p, d, v) -> extra flags
    (2, 1, 1, 1): ["--tensor-model-parallel-size", "2"],
    (1, 2, 2, 1): ["--pipeline-model-parallel-size", "2"],
    (2, 2, 2, 2): ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                   "--virtual-pipeline-model-parallel-size", "2", "--pipeline-schedule", "interleaved"],
}


def validation(records: list[dict]) -> dict[int, float]:
    """iteration -> val_loss, checking val_ppl on the way."""
    out = {}
    for r in records:
        if "val_loss" in r:
            assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]), rel=1e-12)
            out[r["iteration"]] = r["val_loss"]
    return out


def _name(layout: tuple[int, int, int, int]) -> str:
    return "t{}p{}d{}v{}".format(*layout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """One process and every layout, in one ``run_layouts`` (the session's ranks, no process start)."""
    root = tmp_path_factory.mktemp("eval")
    plan = {"serial": (1, ["--save", str(root / "ckpt")]),
            **{_name(layout): (layout[0] * layout[1] * layout[2], flags) for layout, flags in LAYOUTS.items()},
            "eval-off": (1, ["--eval-iters", "0"])}
    return run_layouts(root, plan, base=EVAL, save=False)  # weights: the serial run's own --save only


@pytest.fixture(scope="module")
def serial(runs) -> tuple[dict[int, float], object]:
    return validation(runs["serial"].records), runs["serial"].ckpt


def dense_validation_loss(checkpoint, eval_iters: int = 2) -> float:
    """Mean next-token loss of the full model over the first ``eval_iters`` validation global batches."""
    tensors, config = read_full_model_state(checkpoint)
    model = full_model_from_state(tensors, config)
    tr, m = config["training"], config["model"]
    valid = build_datasets(None, config["data"]["split"], m["seq_length"], tr["seed"]).valid
    micro = tr["global_batch_size"] // tr["micro_batch_size"]
    total = 0.0
    with torch.no_grad():
        for k in range(eval_iters):
            batch = torch.cat([get_microbatch(valid, k, tr["global_batch_size"], 0, 1, tr["micro_batch_size"], j)
                               for j in range(micro)])
            total += language_model_loss(model(batch[:, :-1]), batch[:, 1:]).item()
    return total / eval_iters


def test_single_process_validation_is_the_dense_loss(serial):
    losses, checkpoint = serial
    assert sorted(losses) == [2, 4]
    assert losses[4] < losses[2]  # the model learns between the two evaluations
    assert losses[4] == pytest.approx(dense_validation_loss(checkpoint), rel=1e-5)


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=_name)
def test_every_layout_reports_the_single_process_validation_loss(runs, serial, layout):
    losses = validation(runs[_name(layout)].records)
    assert sorted(losses) == [2, 4]
    for iteration, expected in serial[0].items():
        assert losses[iteration] == pytest.approx(expected, rel=RTOL), iteration


def test_eval_iters_zero_turns_evaluation_off_and_trains_the_same(runs, serial):
    """Megatron-LM's ``--eval-iters 0``: no validation (nor test) loss, and the training itself unchanged."""
    off = runs["eval-off"].records
    assert serial[0] and not validation(off)
    assert [r["loss"] for r in off if "loss" in r] == [r["loss"] for r in runs["serial"].records if "loss" in r]
