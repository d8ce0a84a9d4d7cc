"""--wandb-project (Megatron-LM's flags): the TensorBoard scalars logged to Weights & Biases by rank 0, offline
without WANDB_API_KEY; read back from the offline run's transaction log (run-ID.wandb)."""

from __future__ import annotations

import importlib.util
import json
import os
import struct

import pytest
from helpers import TINY, train_metrics

from ptdp.cli.main import main as ptdp_main

pytest.importorskip("wandb")


def wandb_records(path) -> list:
    """The records of a W&B transaction log: a 7-byte file header, then 32 KiB blocks of records, each a 7-byte
    header (checksum, length, type: 1 whole, 2 first, 3 middle, 4 last piece) and its bytes (a protobuf
    ``Record``, wandb's LevelDB-style log)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the block's tail is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def logged_scalars(directory) -> dict[int, dict[str, float]]:
    """Step -> {tag: value} of the one offline run under ``directory``."""
    (run,) = [p for p in (directory / "wandb").iterdir() if p.name.startswith("offline-run-")]
    (log,) = run.glob("run-*.wandb")
    steps = {}
    for record in wandb_records(log):
        if record.WhichOneof("record_type") != "history":
            continue
        items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
        steps[int(items.pop("_step"))] = {k: v for k, v in items.items() if not k.startswith("_")}
    return steps


@pytest.mark.skipif(bool(os.environ.get("WANDB_API_KEY")), reason="with an API key the run would go online")
def test_wandb_logs_the_tensorboard_scalars_offline(tmp_path):
    directory = tmp_path / "wb"
    records = train_metrics(tmp_path, 1, ["--wandb-project", "ptdp-test", "--wandb-exp-name", "tiny",
                                          "--wandb-save-dir", str(directory), "--eval-interval", "3"])
    steps = logged_scalars(directory)
    assert sorted(steps) == [r["iteration"] for r in records] == [1, 2, 3]
    for record in records:
        logged = steps[record["iteration"]]
        assert {"train/loss", "train/learning_rate", "train/grad_norm", "throughput/tokens_per_s",
                "memory/peak_bytes"} <= logged.keys()
        assert logged["train/loss"] == pytest.approx(record["loss"], rel=1e-6)
        assert logged["train/learning_rate"] == pytest.approx(record["lr"])
    assert steps[3]["val/loss"] == pytest.approx(records[-1]["val_loss"], rel=1e-6)


def test_without_the_wandb_package_the_flag_is_one_line(monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    assert ptdp_main(["train", *TINY, "--wandb-project", "p"]) == 2  # before any training
    assert capsys.readouterr().err.splitlines() == [
        "ptdp train: error: --wandb-project p needs the wandb package: pip install 'ptdp[wandb]'"]


def test_a_wandb_option_without_a_project_is_one_line(capsys):
    assert ptdp_main(["train", *TINY, "--wandb-exp-name", "x"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "ptdp train: error: --wandb-exp-name x is for a Weights & Biases run: give --wandb-project too"]
