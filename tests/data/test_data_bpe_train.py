"""End to end with a trained BPE vocabulary: ``ptdp preprocess --tokenizer bpe`` on JSONL made from
standard-library text, ``ptdp train --data-path PREFIX`` (the loss falls), and ``ptdp generate`` from that
checkpoint, which finds the BPE tokenizer through the saved --data-path."""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import pytest
import torch
from helpers import TINY, losses, run_ptdp, train_metrics

from ptdp.checkpointing import read_full_model_state
from ptdp.cli.generate import generate
from ptdp.cli.main import main as ptdp_main
from ptdp.data import BPETokenizer, load_tokenizer
from ptdp.hf.convert import full_model_from_state

STDLIB_FILES = ("argparse.py", "textwrap.py", "json/decoder.py", "string.py")
PROMPT = "def parse_args(self"
TRAIN = [*TINY, "--train-iters", "30", "--lr", "1e-2", "--lr-warmup-iters", "3", "--log-interval", "10",
         "--adam-beta2", "0.95"]  # GPT-3's beta2: with it this tiny model's greedy text uses merged tokens


def write_jsonl(path: Path) -> int:
    """One document per blank-line-separated block of a few stdlib modules (~150 KB of real text)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = [block for name in STDLIB_FILES
            for block in (stdlib / name).read_text(encoding="utf-8").split("\n\n") if block.strip()]
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    return len(docs)


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("bpe")
    documents = write_jsonl(root / "stdlib.jsonl")
    prefix = root / "stdlib_bpe"
    proc = run_ptdp(["preprocess", "--input", str(root / "stdlib.jsonl"), "--output-prefix", str(prefix),
                     "--tokenizer", "bpe", "--vocab-size", "512"], timeout=120)
    summary = json.loads(proc.stdout.splitlines()[-1])
    records = train_metrics(root, 1, ["--data-path", str(prefix), "--save", str(root / "ckpt")], base=TRAIN)
    return {"root": root, "prefix": prefix, "documents": documents, "summary": summary, "records": records}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # generation runs in this process; the 2 shared cores oversubscribe
    yield
    torch.set_num_threads(threads)


def test_preprocess_trains_a_512_token_vocabulary(bpe_run):
    tokenizer = load_tokenizer(str(bpe_run["prefix"]))
    assert isinstance(tokenizer, BPETokenizer) and tokenizer.vocab_size == 512
    assert bpe_run["summary"]["vocab_size"] == 512 and bpe_run["summary"]["documents"] == bpe_run["documents"]
    text = "    def __init__(self, prog=None):\n        return"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert len(tokenizer.encode(text)) < len(text.encode()) / 2  # merges learnt from the code it saw


def test_training_on_the_bpe_dataset_lowers_the_loss(bpe_run):
    records = bpe_run["records"]
    assert len(records) == 30
    loss = losses(records)
    assert loss[0] == pytest.approx(torch.log(torch.tensor(512.0)).item(), abs=0.3)  # uniform over 512 ids
    # ~0.8 nats down in 30 tiny steps: towards the token frequencies (unigram entropy 5.27 nats)
    assert sum(loss[-5:]) / 5 < loss[0] - 0.6, loss


def test_generate_decodes_through_the_bpe_tokenizer(bpe_run, capsys):
    checkpoint = str(bpe_run["root"] / "ckpt")
    tensors, config = read_full_model_state(checkpoint)
    model = full_model_from_state(tensors, config)
    assert model.vocab_size == 512
    tokenizer = load_tokenizer(str(bpe_run["prefix"]))
    ids = generate(model, tokenizer, tokenizer.encode(PROMPT), 24)
    from ptdp.data import ByteTokenizer

    # only BPE decodes the continuation right (its ids are BPE symbols: 221 is 'Ġ', a space, not byte 221)
    assert tokenizer.decode(ids) != ByteTokenizer().decode(ids), ids
    expected = PROMPT + tokenizer.decode(ids) + "\n"

    assert ptdp_main(["generate", "--load", checkpoint, "--prompt", PROMPT, "--greedy",
                      "--max-new-tokens", "24"]) == 0
    assert capsys.readouterr().out == expected

    # The dataset moved: say so, and accept its new place through --tokenizer-prefix.
    moved = bpe_run["root"] / "moved"
    moved.mkdir()
    for path in bpe_run["root"].glob("stdlib_bpe.*"):
        os.replace(path, moved / path.name)
    assert ptdp_main(["generate", "--load", checkpoint, "--prompt", PROMPT, "--greedy"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--tokenizer-prefix" in err, err
    assert ptdp_main(["generate", "--load", checkpoint, "--prompt", PROMPT, "--greedy", "--max-new-tokens", "24",
                      "--tokenizer-prefix", str(moved / "stdlib_bpe")]) == 0
    assert capsys.readouterr().out == expected
