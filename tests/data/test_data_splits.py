"""Megatron-LM's per-split datasets, ``--skip-train`` and ``--full-validation``, and the norm
biases off with the linear ones (``--disable-bias-norm``).

Equivalence: ``--train-data-path X`` is ``--data-path X --split 100,0,0`` (the same samples, the same
training, bit for bit), ``--valid-data-path Y`` is ``--data-path Y --split 0,100,0``'s validation split;
``--skip-train`` reports the validation loss the training run reported with the same weights, and with
``--full-validation`` the mean loss of the full model over every whole global batch of the split, computed
here outside ptdp's evaluation; a bias-free GPT trains the same on t = 2 with sequence parallelism as on one
process."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import GLOBAL_BATCH, MICRO_BATCH, TINY, assert_equivalent, run_layouts, track

from ptdp.checkpointing import read_full_model_state
from ptdp.cli.main import build_parser
from ptdp.config import config_from_args, validate
from ptdp.data import ByteTokenizer, IndexedDatasetWriter, build_datasets, get_microbatch
from ptdp.data.gpt_dataset import GPTDataset
from ptdp.data.training_data import evaluation_iters
from ptdp.hf.convert import full_model_from_state
from ptdp.parallel.tensor import language_model_loss

NO_BIAS = ["--disable-bias-linear", "--disable-bias-norm"]


def _corpus(prefix: str, letter: str, documents: int) -> str:
    writer = IndexedDatasetWriter(prefix, ByteTokenizer.vocab_size)
    for k in range(documents):
        writer.add_document(ByteTokenizer().encode(f"{letter * 3} {k} {letter} " * (5 + k % 7)) + [ByteTokenizer.eod_id])
    writer.finalize()
    return prefix


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("corpora")
    return {name: _corpus(str(root / name), letter, n) for name, letter, n in
            (("a", "a", 120), ("b", "B", 90), ("c", "c", 60))}


def _samples(dataset) -> list[np.ndarray]:
    return [dataset[i] for i in range(len(dataset))]


@pytest.mark.parametrize("blend", [["a"], ["0.3", "a", "0.7", "b"], ["a", "b"]])
def test_each_split_path_builds_all_of_its_datasets(corpora, blend):
    """--train-data-path builds --data-path with --split 100,0,0's training split, sample for sample; the
    validation and test splits read every document of their datasets."""
    path = [corpora.get(x, x) for x in blend]
    sizes = (48, 32, 16)
    per = build_datasets(None, "969,30,1", 16, 1234, sizes, per_split=[path, path, path])
    want = build_datasets(path, "100,0,0", 16, 1234, sizes).train
    assert len(per.train) == len(want) > 0 and all(map(np.array_equal, _samples(per.train), _samples(want)))
    for split in ("valid", "test"):
        dataset = getattr(per, split)
        members = dataset.datasets if hasattr(dataset, "datasets") else [dataset]
        assert len(members) == (2 if len(path) > 1 else 1)
        for member in members:
            assert member.document_range == (0, member.indexed.num_documents)
            expected = GPTDataset(member.indexed, (0, member.indexed.num_documents), 16, 1234, member.num_samples,
                                  None, split)
            assert all(map(np.array_equal, _samples(member), _samples(expected)))


def test_full_validation_is_every_sample_of_the_split_once(corpora):
    per = build_datasets(None, "969,30,1", 16, 1234, (48, None, 16), whole_valid=True,
                         per_split=[[corpora["a"]], ["0.9", corpora["b"], "0.1", corpora["c"]], []])
    one_epoch = [GPTDataset(d.indexed, d.document_range, 16, 1234, None, None, "valid") for d in per.valid.datasets]
    assert len(per.valid) == sum(map(len, one_epoch)) and per.test is None
    seen = sorted(tuple(s) for s in _samples(per.valid))
    assert seen == sorted(tuple(s) for d in one_epoch for s in _samples(d))  # each sample once, weights aside


def _problems(argv: list[str]) -> list[str]:
    return validate(config_from_args(build_parser().parse_args(["train", *argv])), 1)


@pytest.mark.parametrize("argv, problem", [
    (["--data-path", "x", "--train-data-path", "y"], "--data-path cannot be combined with --train-data-path"),
    (["--valid-data-path", "y"], "need --train-data-path too"),
    (["--full-validation", "--split", "100,0,0"], "--full-validation evaluates the whole validation split"),
    (["--train-data-path", "x", "--full-validation"], "give it one (--valid-data-path)"),
    (["--skip-train", "--split", "100,0,0"], "--skip-train evaluates the validation and test splits"),
    (["--train-data-path", "x", "--skip-train"], "give --valid-data-path or --test-data-path"),
])
def test_data_flag_problems_are_one_line_each(argv, problem):
    problems = _problems(argv)
    assert len(problems) == 1 and problem in problems[0], problems


def test_data_flags_that_fit_give_no_problem():
    assert not _problems(["--train-data-path", "x", "--valid-data-path", "0.5", "y", "0.5", "z", "--skip-train",
                          "--full-validation"])
    assert not _problems(["--data-path", "x", "--skip-train", "--full-validation", *NO_BIAS])


@pytest.fixture(scope="module")
def runs(corpora, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("splits")
    a, b, c = corpora["a"], corpora["b"], corpora["c"]
    splits = ["--train-data-path", a, "--valid-data-path", b, "--test-data-path", c, "--eval-interval", "3",
              "--eval-iters", "2"]
    ckpt = str(root / "trained")
    plan = {
        "data-path": (1, ["--data-path", a, "--split", "100,0,0"]),
        "train-data-path": (1, ["--train-data-path", a]),
        "trained": (1, [*splits, "--save", ckpt]),
        "skip": (1, [*splits, "--skip-train", "--load", ckpt]),
        "skip-full": (1, [*splits, "--skip-train", "--full-validation", "--load", ckpt]),
        "no-bias": (1, NO_BIAS),
        "no-bias-t2-sp": (2, [*NO_BIAS, "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    }
    return run_layouts(root, plan, save={"no-bias", "no-bias-t2-sp"})  # the only weights compared


def test_train_data_path_trains_as_data_path_with_the_whole_split(runs):
    assert track(runs["train-data-path"].records) == track(runs["data-path"].records)  # bit for bit


def test_skip_train_reports_the_trained_validation_loss_and_the_test_split(runs):
    trained = [r for r in runs["trained"].records if "val_loss" in r]
    (skip,) = runs["skip"].records
    assert [r["iteration"] for r in trained] == [3] and skip["iteration"] == 3 and "loss" not in skip
    assert skip["val_loss"] == trained[0]["val_loss"]  # same weights, same batches: the same number
    assert math.isfinite(skip["test_loss"]) and skip["test_ppl"] == pytest.approx(math.exp(skip["test_loss"]))


def _dense_loss(checkpoint, valid, batches: int, batch: int, micro: int) -> float:
    """Mean next-token loss of the full model (one process, outside ptdp's evaluation) over ``batches``."""
    model = full_model_from_state(*read_full_model_state(checkpoint))
    total = 0.0
    with torch.no_grad():
        for k in range(batches):
            x = torch.cat([get_microbatch(valid, k, batch, 0, 1, micro, j) for j in range(batch // micro)])
            total += language_model_loss(model(x[:, :-1]), x[:, 1:]).item()
    return total / batches


def test_full_validation_evaluates_every_whole_global_batch_of_the_split(runs, corpora):
    (skip,) = runs["skip-full"].records
    config = config_from_args(build_parser().parse_args(["train", *TINY, "--full-validation"]))
    valid = build_datasets(None, "969,30,1", 16, 1234, (48, None, 32), whole_valid=True,
                           per_split=[[corpora["a"]], [corpora["b"]], [corpora["c"]]]).valid
    batches = evaluation_iters(config, valid)
    assert batches == len(valid) // GLOBAL_BATCH > 2  # more than --eval-iters 2: the whole split
    assert skip["val_loss"] == pytest.approx(_dense_loss(runs["trained"].ckpt, valid, batches, GLOBAL_BATCH, MICRO_BATCH), rel=1e-5)


def test_no_norm_bias_trains_the_same_on_t2_with_sequence_parallelism(runs):
    assert not [name for name in runs["no-bias"].weights if name.endswith("bias")]
    assert_equivalent(runs["no-bias-t2-sp"], runs["no-bias"])
