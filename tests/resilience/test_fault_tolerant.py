"""Fault-tolerant replica groups (``--fault-tolerant-replicas``, docs/fault-tolerance.md): with no failure,
R = 2 groups of (t, p) = (2, 2) train like one process (loss and gradient norm per iteration, final weights
of both groups), every step in a quorum of both, each group on its own half of each global batch; and the
refusals of what the groups cannot do yet.

The run is the real command: ptdp's launcher starts torchft's lighthouse and two ``ptdp train`` jobs of
four workers each (torchft's quorum, managed gloo process group and commit between them). One job with
tensor AND pipeline parallelism inside each group, rather than one job of (1, 2) and one of (2, 1): the
cross-group average then covers a tensor-parallel shard and a pipeline stage's parameters at once, for
one launcher, lighthouse and pair of group launchers fewer."""

from __future__ import annotations

import json

import pytest
from helpers import TINY, Run, assert_equivalent, run_ptdp


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def replica_runs(tmp_path, layout: list[str], extra: list[str] = ()) -> list[Run]:
    """Train TINY as 2 replica groups of 4 workers; each group's records and final checkpoint."""
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ck"
    # generous timeouts: the first quorum waits for both groups, which start slowly on a loaded machine
    run_ptdp(["train", *TINY, *layout, *extra, "--nproc-per-node", "8", "--fault-tolerant-replicas", "2",
              "--fault-tolerant-timeout-s", "300", "--metrics-file", str(metrics), "--save", str(ckpt)],
             timeout=900)
    return [Run(_records(metrics), ckpt), Run(_records(tmp_path / "m-replica1.jsonl"), tmp_path / "ck-replica1")]


def test_two_groups_train_like_one_process(tmp_path, reference):
    pytest.importorskip("torchft")
    groups = replica_runs(tmp_path, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"])
    for group in groups:
        assert_equivalent(group, reference)
        assert [r["quorum_size"] for r in group.records] == [2] * len(reference.records)
        assert [r["consumed_samples"] for r in group.records] == [r["consumed_samples"] for r in reference.records]
    # each group trained its own half of every global batch: together, the whole of it, once
    shares = [[tuple(r["replica_shares"]) for r in group.records] for group in groups]
    assert all(sorted(a + b) == [0, 1] for a, b in zip(*shares, strict=True)), shares


def test_shares_cover_the_global_batch_once():
    from ptdp.train.replicas import shares_of

    for replicas in (1, 2, 3, 4):
        for participants in range(1, replicas + 1):
            taken = [s for rank in range(participants) for s in shares_of(rank, participants, replicas)]
            assert sorted(taken) == list(range(replicas)), (replicas, participants)
    assert shares_of(None, 2, 2) == []  # not in the quorum: trains nothing


@pytest.mark.parametrize("flags, words", [
    (["--fp16"], "--fp16"),
    (["--calculate-per-token-loss"], "--calculate-per-token-loss"),
    (["--use-distributed-optimizer", "--data-parallel-sharding-strategy", "optim_grads_params"], "ZeRO-3"),
    (["--global-batch-size", "6"], "--fault-tolerant-replicas 2"),
])
def test_refused_with_replicas(flags, words):
    import argparse

    from ptdp.config import add_config_arguments, config_from_args, validate

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    errors = validate(config_from_args(parser.parse_args([*TINY, "--fault-tolerant-replicas", "2", *flags])), 1)
    assert any(words in line for line in errors), errors


def test_nproc_not_divisible_by_replicas(tmp_path):
    pytest.importorskip("torchft")
    proc = run_ptdp(["train", *TINY, "--nproc-per-node", "3", "--fault-tolerant-replicas", "2"], check=False)
    assert proc.returncode == 2
    assert "--nproc-per-node 3 is not divisible by --fault-tolerant-replicas 2" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_cross_group_all_reduce_goes_through_the_door():
    """torchft's managed all-reduce is recorded in the flight recorder before it is issued, as every
    collective of ptdp (a hang in it is then in the hang report)."""
    import torch

    from ptdp.observability import communication, flight_recorder

    seen = []

    class Manager:  # the one method the door calls
        def allreduce(self, tensor, reduce_op=None):
            seen.append((flight_recorder.last_operations()[-1], reduce_op))
            return "work"

    flight_recorder.enable()
    try:
        assert communication.managed_all_reduce(Manager(), torch.zeros(4), action="replica_grads") == "work"
    finally:
        flight_recorder.enable(False)
    record, op = seen[0]
    assert record["kind"] == "managed_all_reduce" and record["action"] == "replica_grads" and record["bytes"] == 16
    assert op == torch.distributed.ReduceOp.SUM  # summed, then divided by R: every share counted once


def test_each_group_has_its_own_files():
    """Group g > 0 writes its metrics and checkpoints beside the run's, and resumes its own directory when
    --load continues --save (another run's --load, e.g. a pretrained model, is every group's)."""
    from ptdp.runtime.replicas import group_argv

    argv = ["train", "--save", "ck", "--load", "ck", "--metrics-file", "out/m.jsonl", "--nproc-per-node", "4"]
    assert group_argv(argv, 2, 0, "ck", "out/m.jsonl", "ck")[-2:] == ["--nproc-per-node", "2"]
    assert group_argv(argv, 2, 1, "ck", "out/m.jsonl", "ck")[-8:] == [
        "--nproc-per-node", "2", "--save", "ck-replica1", "--load", "ck-replica1", "--metrics-file",
        "out/m-replica1.jsonl"]
    assert "--load" not in group_argv(["train", "--nproc-per-node=4"], 2, 1, "ck", None, "pretrained")
