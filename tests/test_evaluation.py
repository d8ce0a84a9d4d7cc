"""Validation loss (``--eval-interval``/``--eval-iters``): every layout reports the single-process value,
and the single-process value is the dense mean loss of the saved model over the validation batches."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import TINY, train_metrics

from ptdp.checkpointing import read_full_model_state
from ptdp.data import build_datasets, get_microbatch
from ptdp.hf import full_model_from_state
from ptdp.train.step import language_model_loss

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


@pytest.fixture(scope="module")
def serial(tmp_path_factory) -> tuple[dict[int, float], object]:
    root = tmp_path_factory.mktemp("eval")
    records = train_metrics(root, 1, ["--save", str(root / "ckpt")], base=EVAL)
    return validation(records), root / "ckpt"


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


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=lambda tpdv: "t{}p{}d{}v{}".format(*tpdv))
def test_every_layout_reports_the_single_process_validation_loss(tmp_path, serial, layout):
    t, p, d, _ = layout
    losses = validation(train_metrics(tmp_path, t * p * d, LAYOUTS[layout], base=EVAL))
    assert sorted(losses) == [2, 4]
    for iteration, expected in serial[0].items():
        assert losses[iteration] == pytest.approx(expected, rel=RTOL), iteration
