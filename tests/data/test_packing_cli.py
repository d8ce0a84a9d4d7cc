"""Packed documents at the command line: bad input is one line (exit 2), ``ptdp samples`` shows the
boundaries, ``ptdp plan`` and the progress line count only the attention inside the documents."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import refused_in_process, run_ptdp
from test_cli_messages import one_error

from ptdp.models import flops

SMALL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--lr-warmup-iters", "1",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--tokenizer-type",
         "ByteTokenizer", "--split", "1,0,0"]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    from ptdp.data import ByteTokenizer, IndexedDatasetWriter

    root = tmp_path_factory.mktemp("corpora")
    rng = np.random.default_rng(0)
    for name, eod in (("docs", True), ("noeod", False)):
        writer = IndexedDatasetWriter(str(root / name), ByteTokenizer.vocab_size)
        for _ in range(200):
            writer.add_document([*rng.integers(97, 123, int(rng.integers(1, 12))), *([256] if eod else [])])
        writer.finalize()
    return root


def test_the_flags_on_a_dataset_without_end_of_document_tokens_are_one_line(corpora, capsys):
    proc = refused_in_process(["train", *SMALL, "--data-path", str(corpora / "noeod"), "--reset-attention-mask"],
                              capsys)
    line = one_error(proc, "ptdp")
    assert "--reset-attention-mask" in line and "no end-of-document token (id 256)" in line


def test_samples_show_the_boundaries_and_the_progress_line_counts_document_attention(corpora, tmp_path):
    argv = [*SMALL, "--data-path", str(corpora / "docs"), "--reset-attention-mask", "--eod-mask-loss"]
    out = run_ptdp(["samples", *argv, "--first", "3"]).stdout.splitlines()
    for line in out:
        record = json.loads(line)
        tokens = np.array(record["tokens"])
        ends = [i + 1 for i in np.flatnonzero(tokens == 256) if i + 1 < len(tokens)]
        assert record["cu_seqlens"] == [0, *ends, len(tokens)]
        assert record["loss_masked_positions"] == np.flatnonzero(tokens == 256).tolist()
    assert "cu_seqlens" not in run_ptdp(["samples", *SMALL, "--data-path", str(corpora / "docs"), "--first", "1"]).stdout

    metrics = tmp_path / "m.jsonl"
    proc = run_ptdp(["train", *argv, "--metrics-file", str(metrics)])
    assert proc.stdout.count("document attention: per-document SDPA") == 1
    assert "attention inside documents only: sum(l^2)/s =" in proc.stdout
    first = json.loads(metrics.read_text().splitlines()[0])
    # the counted FLOPs are eq. 3 with the attention term of the documents of iteration 1's samples
    rows = [json.loads(line) for line in out] + [json.loads(line) for line in run_ptdp(
        ["samples", *argv, "--start", "3", "--first", "1"]).stdout.splitlines()]
    squares = sum(sum(b * b for b in np.diff(r["cu_seqlens"])) for r in rows)
    assert first["attention_length"] == pytest.approx(squares / (4 * 32))
    assert first["attention_length"] < 32 / 2  # short documents: far less attention than the window's


def test_plan_counts_the_attention_of_the_documents():
    from ptdp.cli.main import main

    def count(attention_length: float | None) -> int:
        return flops.flops_per_iteration(2, 64, 4096, 1000, 8, recompute=False, attention_length=attention_length)

    whole, documents = count(None), count(384.0)
    attention = 2 * 3 * 4 * 8 * 4096 * 64  # layers x passes x 4·B·s·h per unit of attended keys
    assert whole - documents == attention * (4096 - 384)
    base = ["plan", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "4096",
            "--vocab-size", "1000", "--global-batch-size", "8", "--gpus", "1", "--tensor-model-parallel-size", "1",
            "--pipeline-model-parallel-size", "1", "--json"]
    assert main(base + ["--reset-attention-mask"]) == 2  # the documents' length is needed
    assert main(base + ["--mean-document-length", "384"]) == 2  # and only with the flag


def test_plan_json_has_the_documents_flops(capsys):
    from ptdp.cli.main import main

    base = ["plan", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "4096",
            "--vocab-size", "1000", "--global-batch-size", "8", "--gpus", "1", "--tensor-model-parallel-size", "1",
            "--pipeline-model-parallel-size", "1", "--json"]
    assert main(base) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main(base + ["--reset-attention-mask", "--mean-document-length", "384"]) == 0
    documents = json.loads(capsys.readouterr().out)
    assert documents["flops_per_iteration"] == flops.flops_per_iteration(
        2, 64, 4096, 1000, 8, recompute=False, attention_length=384.0)
    assert documents["iteration_time_s"] < whole["iteration_time_s"]


def test_learned_positions_restart_in_every_document():
    """GPT-2's learned position embeddings read the restarted positions: a packed document's logits are
    those of the document alone (RoPE, being relative, could not tell; tests/data/test_packing.py is Llama's)."""
    from ptdp.config import ModelConfig
    from ptdp.data.documents import cu_seqlens, positions
    from ptdp.models import GPTModel
    from ptdp.models.documents import DocumentLayout
    from ptdp.ops.document_attention import PerDocument
    from ptdp.parallel.tensor.random import MODEL_PARALLEL_RNG, get_rng_tracker

    tracker = get_rng_tracker()
    if MODEL_PARALLEL_RNG not in tracker.states:
        tracker.add(MODEL_PARALLEL_RNG, 1234)
    torch.manual_seed(0)
    model = GPTModel(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32,
                                 hidden_dropout=0.0, attention_dropout=0.0), 256, 256).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    row = torch.tensor([5, 6, 7, 255, 8, 9, 10, 11, 255, 12, 13, 14])
    bounds = cu_seqlens(row.numpy(), 255)
    ids = torch.from_numpy(positions(bounds))[None]
    with torch.no_grad():
        packed = model(row[None], DocumentLayout([bounds], ids, PerDocument()))[0]
        attention_only = model(row[None], DocumentLayout([bounds], None, PerDocument()))[0]
        for a, e in zip(bounds[:-1], bounds[1:]):
            torch.testing.assert_close(packed[a:e], model(row[None, a:e])[0], rtol=1e-5, atol=1e-5)
    a, e = bounds[1], bounds[2]
    assert not torch.allclose(attention_only[a:e], packed[a:e], atol=1e-3)  # the positions matter here
