"""Changing the data mix at a resume: a blend A 0.5 / B 0.5 trains 8 iterations and saves; runs
resume it with A 0.2 / B 0.5 / C 0.3 (uninterrupted, at another d, and SIGKILLed then resumed) or with the
same blend. What every rank trained on is recorded microbatch by microbatch and matched with ``ptdp samples``,
whose ``dataset_sample`` (the index in that dataset's own order) then shows: no sample twice, each dataset
continuing where it stopped, each dataset's share of every global batch its weight to within one sample."""

from __future__ import annotations

import functools
import json
import os
import signal
from collections import Counter
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from helpers import _run_layouts, spawn
from test_data_megatron import random_corpus

from ptdp.cli.main import main

B = 16
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", str(B), "--train-iters", "16", "--lr", "1e-3",
        "--lr-warmup-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "4",
        "--seed", "5", "--split", "969,30,1"]
WEIGHTS = {"a": 0.2, "b": 0.5, "c": 0.3}


def _blend(root: Path, weights: dict[str, float]) -> list[str]:
    return ["--data-path", *[x for name, w in weights.items() for x in (str(w), str(root / name))]]


def _record(kill_at: dict[str, int], rank: int, out: str, name: str) -> None:
    """``helpers._run_layouts``' stage hook: every microbatch a rank loads in stage ``name`` goes to
    ``out/name.RANK``, and at iteration ``kill_at[name]`` every rank SIGKILLs itself before loading it."""
    import ptdp.train.batches as step

    real = getattr(step.get_microbatch, "real", step.get_microbatch)

    def recording(dataset, it0, batch, dp_rank, dp_size, micro, j):
        if kill_at.get(name) == it0 + 1:
            os.kill(os.getpid(), signal.SIGKILL)
        rows = real(dataset, it0, batch, dp_rank, dp_size, micro, j)
        with open(f"{out}/{name}.{rank}", "a") as f:
            f.write(json.dumps([it0 + 1, dp_rank, j, rows.tolist()]) + "\n")
        return rows

    recording.real = real
    step.get_microbatch = recording


def trained(out: Path, name: str) -> dict[int, list[list[int]]]:
    """Per iteration, the samples (``seq_length + 1`` ids each) in stream order: by dp rank, microbatch, row."""
    seen = {}
    for path in out.glob(f"{name}.*"):
        for line in path.read_text().splitlines():
            it, dp_rank, j, rows = json.loads(line)
            seen[(it, dp_rank, j)] = rows
    by_iteration: dict[int, list] = {}
    for key in sorted(seen):
        by_iteration.setdefault(key[0], []).extend(seen[key])
    return by_iteration


def shown(capsys, args: list[str], iterations, code: int = 0) -> dict[int, list[dict]]:
    """``ptdp samples --iteration N`` for each N, in stream order (dp rank, microbatch, row)."""
    out = {}
    for it in iterations:
        capsys.readouterr()
        assert main(["samples", *args, "--iteration", str(it)]) == code
        records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        out[it] = sorted(records, key=lambda r: r["sample"])
    return out


def tokens(records: dict[int, list[dict]]) -> dict[int, list[list[int]]]:
    return {it: [r["tokens"] + r["labels"][-1:] for r in rows] for it, rows in records.items()}


def per_dataset(records: dict[int, list[dict]]) -> dict[str, list[int]]:
    """Dataset name -> its sample indices (in its own order), in the order training read them."""
    out: dict[str, list[int]] = {}
    for it in sorted(records):
        for r in records[it]:
            out.setdefault(Path(r["dataset"]).name, []).append(r["dataset_sample"])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        random_corpus(str(root / name), seed, n_docs=200, vocab=257)
    first, second = _blend(root, {"a": 0.5, "b": 0.5}), _blend(root, WEIGHTS)
    ck = {name: str(root / f"ck-{name}") for name in ("first", "second", "elastic", "same", "killed")}
    out = root / "seen"
    out.mkdir()
    plan = [("first", 2, [*BASE, *first, "--exit-interval", "8", "--save", ck["first"]]),
            ("second", 2, [*BASE, *second, "--load", ck["first"], "--save", ck["second"],
                           "--metrics-file", str(root / "second.jsonl")]),
            ("elastic", 1, [*BASE, *second, "--load", ck["first"], "--save", ck["elastic"]]),
            ("same", 2, [*BASE, *first, "--load", ck["first"], "--save", ck["same"]]),
            ("killed", 2, [*BASE, *second, "--load", ck["first"], "--save", ck["killed"], "--save-interval", "2"])]
    with pytest.raises(mp.ProcessExitedException):  # the last stage SIGKILLs itself in iteration 13
        spawn(_run_layouts, 2, root, str(out), plan, functools.partial(_record, {"killed": 13}))
    spawn(_run_layouts, 2, root, str(out), [("resumed", 2, [*BASE, *second, "--load", ck["killed"], "--save",
                                                             ck["killed"]])], functools.partial(_record, {}))
    return root, out, first, second, ck


def test_a_changed_mix_continues_every_dataset_without_a_repeat(runs, capsys):
    root, out, first, second, ck = runs
    part1 = shown(capsys, [*BASE, *first, "--nproc-per-node", "2"], range(1, 9))
    part2 = shown(capsys, [*BASE, *second, "--nproc-per-node", "2", "--load", ck["first"]], range(9, 17))
    assert tokens(part1) == trained(out, "first")  # ptdp samples shows what training read, in order
    assert tokens(part2) == trained(out, "second")
    before, after = per_dataset(part1), per_dataset(part2)
    assert sorted(before) == ["a", "b"] and sorted(after) == ["a", "b", "c"]
    assert before["a"] == list(range(64)) and before["b"] == list(range(64))  # 0.5 / 0.5 of 8 x 16
    for name, indices in after.items():
        start = len(before.get(name, []))  # continues at its first unread sample; C starts at 0
        assert indices == list(range(start, start + len(indices))), name
        assert not set(indices) & set(before.get(name, [])), name
    for it, rows in part2.items():  # each global batch: the new weights to within one sample
        counts = Counter(Path(r["dataset"]).name for r in rows)
        for name, weight in WEIGHTS.items():
            assert abs(counts[name] - weight * B) <= 1, (it, name, counts)
    mix = json.loads((root / "second.jsonl").read_text().splitlines()[0])["data_mix"]
    assert mix["changed"] and mix["iteration"] == 8 and mix["consumed_samples"] == 128
    assert [(Path(d["prefix"]).name, d["consumed"], d["old_weight"], d["new_weight"]) for d in mix["datasets"]] == [
        ("a", 64, 0.5, 0.2), ("b", 64, 0.5, 0.5), ("c", 0, None, 0.3)]
    assert all(d["remaining_in_epoch"] > 0 for d in mix["datasets"])
    state = json.loads((Path(ck["second"]) / "iter_0000016" / "ptdp.json").read_text())["data"]
    assert state["consumed_samples"] == 256 and state["blend"]["start_sample"] == 128
    assert [d["consumed"] for d in state["datasets"]] == [64 + len(after["a"]), 64 + len(after["b"]), len(after["c"])]


def test_killed_and_resumed_and_elastic_equal_the_uninterrupted_second_part(runs, capsys):
    _, out, _, blend, ck = runs
    second, killed, resumed = trained(out, "second"), trained(out, "killed"), trained(out, "resumed")
    assert sorted(killed) == list(range(9, 13)) and sorted(resumed) == list(range(13, 17))
    assert {**killed, **resumed} == second
    assert trained(out, "elastic") == second  # d = 1 after d = 2, with the new blend
    # the second part's own checkpoint rebuilds the blend it began at iteration 8
    assert tokens(shown(capsys, [*BASE, *blend, "--load", ck["second"]], range(9, 17))) == second


def test_an_unchanged_blend_reads_the_uninterrupted_order(runs, capsys):
    _, out, first, _, _ = runs
    uninterrupted = shown(capsys, [*BASE, *first, "--nproc-per-node", "2"], range(9, 17))  # no --load
    assert trained(out, "same") == tokens(uninterrupted)


def test_extreme_weights_and_a_new_global_batch_size(runs, capsys):
    root, _, _, _, ck = runs
    before = per_dataset(shown(capsys, [*BASE, *_blend(root, {"a": 0.5, "b": 0.5})], range(1, 9)))
    for fresh in ({"a": 0.001, "b": 0.999}, {"a": 0, "b": 0.7, "c": 0.3}):  # from the start too
        got = per_dataset(shown(capsys, [*BASE, *_blend(root, fresh)], range(1, 17)))
        assert all(v == list(range(len(v))) for v in got.values()), fresh  # each in its order, none twice
        assert ("a" in got) == (fresh["a"] > 0) and sum(map(len, got.values())) == 16 * B, fresh
    flags = [*BASE, *_blend(root, {"a": 0, "b": 0.999, "c": 0.001}), "--load", ck["first"]]
    after = per_dataset(shown(capsys, flags, range(9, 17)))
    assert "a" not in after and after["b"] == list(range(64, 64 + len(after["b"])))  # a kept at weight 0: stops
    assert after.get("c", []) == list(range(len(after.get("c", []))))
    from helpers import validated_config

    from ptdp.checkpointing.storage import latest_info
    from ptdp.data.train_stream import summary_lines
    from ptdp.data.training_data import datasets_for_config

    config = validated_config(flags)
    resumed = datasets_for_config(config, *latest_info(config.checkpoint.load)).train.resumed
    lines = summary_lines(resumed)
    assert len(lines) == 4 and lines[1].endswith("weight 0.5 -> 0") and " 64 samples consumed, " in lines[1]
    assert [row["remaining_in_epoch"] > 0 for row in resumed["datasets"]] == [True] * 3
    flags = [*BASE, *_blend(root, {"a": 0.001, "b": 0.999}), "--load", ck["first"]]
    after = per_dataset(shown(capsys, flags, range(9, 17)))
    for name in after:
        assert after[name] == list(range(len(before[name]), len(before[name]) + len(after[name])))
    big = [*BASE, "--global-batch-size", str(2 * B)]  # B 16 -> 32 at the same blend: the stream goes on
    records = shown(capsys, [*big, *_blend(root, {"a": 0.5, "b": 0.5}), "--load", ck["first"]], range(9, 13))
    after = per_dataset(records)
    assert after["a"] == list(range(64, 128)) and after["b"] == list(range(64, 128))
    assert all(len(rows) == 2 * B for rows in records.values())
    records = shown(capsys, [*big, *_blend(root, WEIGHTS), "--load", ck["first"]], range(9, 13))  # both at once
    for name, indices in per_dataset(records).items():
        start = 64 if name != "c" else 0
        assert indices == list(range(start, start + len(indices))), name
    for rows in records.values():
        counts = Counter(Path(r["dataset"]).name for r in rows)
        assert all(abs(counts[name] - w * 2 * B) <= 1 for name, w in WEIGHTS.items()), counts
    capsys.readouterr()
    assert main(["samples", *big, *_blend(root, {"a": 0.5, "b": 0.5}), "--load", ck["first"], "--iteration", "4"]) == 2
    assert "earlier data mix or batch size" in capsys.readouterr().err


def test_a_checkpoint_without_data_state_resumes_by_iteration(runs, capsys, tmp_path):
    import shutil

    from ptdp.checkpointing.storage import read_info, write_checksums, write_info

    root, _, first, _, ck = runs
    old = tmp_path / "old" / "iter_0000008"
    shutil.copytree(Path(ck["first"]) / "iter_0000008", old)
    (old.parent / "latest").write_text("8\n")
    info = read_info(old)
    del info["data"]
    write_info(old, info)
    (old / "checksums.sha256").unlink()
    write_checksums(old)
    resumed = shown(capsys, [*BASE, *first, "--load", str(old.parent)], range(9, 11))
    assert tokens(resumed) == tokens(shown(capsys, [*BASE, *first], range(9, 11)))


def test_errors_are_one_line_exit_2_and_override_starts_the_dataset_over(runs, capsys, tmp_path):
    import shutil

    root, _, _, _, ck = runs
    data = tmp_path / "data"
    shutil.copytree(root, data, ignore=shutil.ignore_patterns("ck-*", "seen", "*.jsonl", "store-*"))
    load = tmp_path / "ck"
    shutil.copytree(ck["first"], load)
    info_path = load / "iter_0000008" / "ptdp.json"
    info = json.loads(info_path.read_text())
    for member in info["data"]["datasets"]:  # the checkpoint as if it had read these copies
        member["prefix"] = str(data / Path(member["prefix"]).name)
    from ptdp.checkpointing.storage import write_checksums

    info_path.write_text(json.dumps(info))
    (load / "iter_0000008" / "checksums.sha256").unlink()
    write_checksums(load / "iter_0000008")
    random_corpus(str(data / "a"), 9, n_docs=200, vocab=257)  # another corpus under the same prefix
    flags = [*BASE, *_blend(data, WEIGHTS), "--load", str(load)]
    for command in ("train", "samples"):
        capsys.readouterr()
        assert main([command, *flags, *(["--iteration", "9"] if command == "samples" else [])]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(data / "a") in err and "--override-data-state" in err, err
        assert "Traceback" not in err
    after = per_dataset(shown(capsys, [*flags, "--override-data-state"], range(9, 17)))
    assert after["a"] == list(range(len(after["a"])))  # started over; b continues
    assert after["b"] == list(range(64, 64 + len(after["b"])))
    bad = [*BASE, "--data-path", "0.2", str(data / "a"), "0.5", str(data / "b"), "0.3", "--load", str(load)]
    for command in ("train", "samples"):
        capsys.readouterr()
        assert main([command, *bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--data-path" in err and "Traceback" not in err, err
