"""``ptdp samples``: what training read, rank by rank and microbatch by microbatch, before and after a kill and
resume; the first samples equal Megatron's GPTDataset algorithm; bad input is one line."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
import torch.multiprocessing as mp
from helpers import GLOBAL_BATCH, MICRO_BATCH, TINY, spawn
from test_data_megatron import megatron_blend, megatron_indices, megatron_sample, random_corpus

from ptdp.cli.main import main

LAYOUT = ["--pipeline-model-parallel-size", "2", "--seed", "5", "--split", "969,30,1"]


def samples(capsys, *args) -> list[dict]:
    capsys.readouterr()
    assert main(["samples", *args]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def _train_and_record(rank: int, world: int, args: list[str], out: str, kill_at: int | None) -> None:
    """One rank of ``ptdp train``: every microbatch it loads goes to ``out.RANK`` (killed at ``kill_at``)."""
    import ptdp.train.batches as batches
    import ptdp.train.loop as training
    from ptdp.config import add_config_arguments, config_from_args

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    real = batches.get_microbatch  # what the trainer's Microbatches read

    def recording(dataset, it0, B, dp_rank, dp_size, b, j):
        if kill_at is not None and it0 + 1 == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        batch = real(dataset, it0, B, dp_rank, dp_size, b, j)
        with open(f"{out}.{rank}", "a") as f:
            f.write(json.dumps([it0 + 1, dp_rank, j, batch.tolist()]) + "\n")
        return batch

    batches.get_microbatch = recording
    import argparse

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    training.train(config_from_args(parser.parse_args(args)))


def recorded(out: str, world: int) -> dict:
    seen = {}
    for r in range(world):
        for line in open(f"{out}.{r}"):
            it, dp_rank, j, rows = json.loads(line)
            seen.setdefault((it, dp_rank, j), rows)
            assert seen[(it, dp_rank, j)] == rows  # both pipeline stages of a replica read the same
    return seen


def test_samples_iteration_equals_what_every_rank_trained_on_across_a_kill_and_resume(tmp_path, capsys):
    prefix = str(tmp_path / "data")
    random_corpus(prefix, 3, n_docs=200, vocab=257)
    ckpt = str(tmp_path / "ckpt")
    args = [*TINY, *LAYOUT, "--data-path", prefix, "--train-iters", "4", "--save", ckpt, "--save-interval", "2",
            "--load", ckpt]
    out = str(tmp_path / "seen")
    with pytest.raises(mp.ProcessExitedException):  # SIGKILL during iteration 3, after the checkpoint at 2
        spawn(_train_and_record, 4, tmp_path, args, out, 3)
    first = recorded(out, 4)
    assert {k[0] for k in first} == {1, 2}
    for path in tmp_path.glob("seen.*"):
        path.unlink()
    spawn(_train_and_record, 4, tmp_path, args, out, None)  # resumes from iteration 2
    second = recorded(out, 4)
    assert {k[0] for k in second} == {3, 4}
    for part in (first, second):
        for it in {k[0] for k in part}:
            shown = samples(capsys, *args, "--iteration", str(it), "--nproc-per-node", "4")
            got = {}
            for rec in shown:
                assert rec["iteration"] == it and len(rec["tokens"]) == 16
                got.setdefault((it, rec["dp_rank"], rec["microbatch"]), []).append(rec["tokens"] + rec["labels"][-1:])
            want = {k: v for k, v in part.items() if k[0] == it}
            assert got == want  # the same ids, ranks and microbatch indices, in order
            assert len(got) == GLOBAL_BATCH // MICRO_BATCH  # d = 2 replicas x m = B / (b x d) microbatches


@pytest.mark.parametrize("seed", [1, 99])
def test_first_samples_equal_megatrons_order_one_prefix_and_a_blend(tmp_path, capsys, seed):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    seqs = {a: random_corpus(a, 1, n_docs=300), b: random_corpus(b, 2, n_docs=200)}
    flags = ["--seq-length", "16", "--seed", str(seed), "--split", "969,30,1", "--global-batch-size", "8",
             "--micro-batch-size", "2", "--train-iters", "50", "--first", "40"]
    one = samples(capsys, *flags, "--data-path", a)
    sizes = np.asarray([len(x) for x in seqs[a]], np.int32)
    n_train = 291  # round(0.969 * 300)
    doc, sample, shuffle = megatron_indices(sizes, np.arange(n_train, dtype=np.int32), 16, seed, 400)
    for rec in one:
        text = megatron_sample(seqs[a].__getitem__, doc, sample, shuffle, rec["sample"], 16)
        assert rec["tokens"] == text[:-1] and rec["labels"] == text[1:] and rec["dataset"] == a
    blend = samples(capsys, *flags, "--data-path", "0.4", a, "0.6", b)
    members = {}
    for prefix, w, n_docs in ((a, 0.4, 300), (b, 0.6, 200)):
        sizes = np.asarray([len(x) for x in seqs[prefix]], np.int32)
        want = int(np.ceil(np.ceil(400 * w) * 1.005))
        members[prefix] = megatron_indices(sizes, np.arange(round(0.969 * n_docs), dtype=np.int32), 16, seed, want)
    for rec, (k, j) in zip(blend, megatron_blend([0.4, 0.6], 40)):
        prefix = (a, b)[k]
        text = megatron_sample(seqs[prefix].__getitem__, *members[prefix], j, 16)
        assert rec["dataset"] == prefix and rec["tokens"] + rec["labels"][-1:] == text


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    for args, fragment in ((["--data-path", str(tmp_path / "nope")], "nope.bin"),
                           (["--data-path", "0.5", "x", "0.5"], "--data-path"),
                           (["--global-batch-size", "7", "--micro-batch-size", "2"], "global"),
                           (["--iteration", "0"], "--iteration")):
        capsys.readouterr()
        assert main(["samples", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and fragment in err and "Traceback" not in err, err


def test_first_limits_a_blend_with_or_without_iteration(tmp_path, capsys):
    """``--first 2`` prints exactly 2 samples: it was ignored with ``--iteration``, which printed the whole
    global batch (32 with the default flags); with ``--iteration`` they are the batch's first two."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    random_corpus(a, 1, n_docs=300)
    random_corpus(b, 2, n_docs=200)
    blend = ["--data-path", "0.5", a, "0.5", b, "--seq-length", "16"]
    assert len(samples(capsys, *blend, "--first", "2")) == 2
    batch = samples(capsys, *blend, "--iteration", "2")
    assert len(batch) == 32 and {r["dataset"] for r in batch} == {a, b}
    assert samples(capsys, *blend, "--iteration", "2", "--first", "2") == batch[:2]
    assert main(["samples", *blend, "--iteration", "2", "--start", "3"]) == 2
    assert capsys.readouterr().err.startswith("ptdp samples: error: --start 3 and --iteration 2: give one of them")
