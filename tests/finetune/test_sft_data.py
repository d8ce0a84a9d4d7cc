"""Chat data for supervised fine-tuning (docs/sft.md): ``ptdp preprocess --sft`` against transformers'
``apply_chat_template``, the by-role mask, bad input, Parquet/Arrow rows byte for byte as JSONL, the packed
SFT samples and their loss weights, a packed sample against its conversations run alone, a short ``ptdp
train --sft``, and its layouts (d, c, t + SP, p, ZeRO-3) against one process."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from helpers import refused_in_process, run_ptdp, tiny_hf_llama_and_ours  # noqa: E402
from sft_helpers import CONVERSATIONS, MARKED, PLAIN, chat_tokenizer, write_chats  # noqa: E402

from ptdp.cli.main import main  # noqa: E402
from ptdp.data import DataError, IndexedDataset  # noqa: E402
from ptdp.data.sft_dataset import LOSS_MASK_SUFFIX, SFTDataset, SFTOptions  # noqa: E402


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-tokenizers")
    return {name: chat_tokenizer(root / name, template)
            for name, template in (("marked", MARKED), ("plain", PLAIN), ("none", None))}


def _preprocess(tmp_path, tokenizer: str, name: str = "chat", extra=(), chats=None) -> tuple[int, str]:
    chats = chats or write_chats(tmp_path / "chats.jsonl")
    prefix = str(tmp_path / "out" / name)
    code = main(["preprocess", "--input", chats, "--output-prefix", prefix, "--sft", "--tokenizer-type",
                 "HuggingFaceTokenizer", "--tokenizer-model", tokenizer, *extra])
    return code, prefix


def _documents(prefix: str) -> list[tuple[list[int], list[int]]]:
    ids, masks = IndexedDataset(prefix), IndexedDataset(prefix + LOSS_MASK_SUFFIX)
    return [(ids.document(k).tolist(), masks.document(k).tolist()) for k in range(ids.num_documents)]


@pytest.mark.parametrize("workers", [1, 2])
def test_ids_and_mask_equal_transformers_apply_chat_template_with_generation_markers(tmp_path, tokenizers, workers,
                                                                                      capsys):
    code, prefix = _preprocess(tmp_path, tokenizers["marked"], extra=["--workers", str(workers)])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["mask_rule"] == "generation markers" and summary["documents"] == len(CONVERSATIONS)
    hf = transformers.AutoTokenizer.from_pretrained(tokenizers["marked"])
    for (ids, mask), messages in zip(_documents(prefix), CONVERSATIONS, strict=True):
        want = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids == list(want["input_ids"])
        assert mask == list(want["assistant_masks"]) and any(mask)
    assert os.path.exists(prefix + ".tokenizer.json")  # train finds the tokenizer without flags


def _runs(ids: list[int], mask: list[int], hf) -> list[str]:
    """The texts of the runs of masked tokens."""
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(hf.decode(current))
            current = []
    return runs + ([hf.decode(current)] if current else [])


def test_by_role_fallback_marks_exactly_the_assistant_turns(tmp_path, tokenizers, capsys):
    """Without markers: each assistant turn (its content and the end-of-turn text the template closes it with)
    and nothing else; the ids are still apply_chat_template's."""
    code, prefix = _preprocess(tmp_path, tokenizers["plain"])
    assert code == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["mask_rule"] == "by role"
    hf = transformers.AutoTokenizer.from_pretrained(tokenizers["plain"])
    for (ids, mask), messages in zip(_documents(prefix), CONVERSATIONS, strict=True):
        assert ids == list(hf.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
        assert _runs(ids, mask, hf) == [m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant"]


def test_chat_template_flag_replaces_the_tokenizers(tmp_path, tokenizers):
    template = tmp_path / "chat.jinja"
    template.write_text(MARKED)
    code, prefix = _preprocess(tmp_path, tokenizers["none"], extra=["--chat-template", str(template)])
    assert code == 0
    code, marked = _preprocess(tmp_path, tokenizers["marked"], name="marked")
    assert _documents(prefix) == _documents(marked)


BAD_ROWS = {
    "no-messages": ({"text": "hello"}, "no \"messages\" list"),
    "unknown-role": ({"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]},
                     "unknown role 'bot'"),
    "no-assistant": ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_a_bad_row_is_one_line_naming_file_and_row_exit_2_nothing_written(tmp_path, tokenizers, capsys, case):
    row, reason = BAD_ROWS[case]
    chats = tmp_path / "chats.jsonl"
    with open(chats, "w") as fh:  # the bad row is row 3 (1-based), after two good ones
        for line in [{"messages": CONVERSATIONS[0]}, {"messages": CONVERSATIONS[1]}, row, {"messages": CONVERSATIONS[2]}]:
            fh.write(json.dumps(line) + "\n")
    capsys.readouterr()
    code, _ = _preprocess(tmp_path, tokenizers["marked"], chats=str(chats), extra=["--workers", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"{chats}: row 3: " in err[0] and reason in err[0]
    assert os.listdir(tmp_path / "out") == []


def test_a_tokenizer_without_chat_template_is_one_line_exit_2(tmp_path, tokenizers, capsys):
    code, _ = _preprocess(tmp_path, tokenizers["none"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "no chat template" in err[0] and "--chat-template" in err[0], err
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


def _columnar(path, rows: list[dict]) -> str:
    """``rows`` as a Parquet file or an Arrow IPC stream (by ``path``'s suffix)."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.ipc
    import pyarrow.parquet

    table = pa.Table.from_pylist(rows)
    if str(path).endswith(".parquet"):
        pyarrow.parquet.write_table(table, str(path), row_group_size=2)
    else:
        with pa.OSFile(str(path), "wb") as sink, pyarrow.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=2)
    return str(path)


def _files(prefix: str) -> dict[str, bytes]:
    return {suffix: open(prefix + suffix, "rb").read()
            for suffix in (".bin", ".idx", LOSS_MASK_SUFFIX + ".bin", LOSS_MASK_SUFFIX + ".idx")}


@pytest.mark.parametrize("suffix, workers", [(".parquet", 1), (".arrow", 2)])
def test_parquet_and_arrow_chats_give_the_jsonl_files_byte_for_byte(tmp_path, tokenizers, suffix, workers):
    """A ``messages`` column of structs (role, content; a message without a field has it null, as a column of
    structs stores it) renders exactly as the same rows in JSONL."""
    conversations = [*CONVERSATIONS, [{"role": "user", "content": "hi", "name": "ann"},
                                      {"role": "assistant", "content": "hello"}]] * 2
    code, jsonl = _preprocess(tmp_path, tokenizers["marked"], "jsonl",
                              chats=write_chats(tmp_path / "chats.jsonl", conversations))
    assert code == 0
    rows = _columnar(tmp_path / f"chats{suffix}", [{"id": k, "messages": c} for k, c in enumerate(conversations)])
    code, columnar = _preprocess(tmp_path, tokenizers["marked"], "columnar", chats=rows,
                                 extra=["--workers", str(workers)])
    assert code == 0
    assert _files(columnar) == _files(jsonl) and IndexedDataset(jsonl).num_documents == len(conversations)


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
def test_a_bad_columnar_row_names_file_and_row_and_a_missing_column_the_file(tmp_path, tokenizers, capsys, suffix):
    rows = [{"messages": CONVERSATIONS[0]}, {"messages": CONVERSATIONS[1]},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]},
            {"messages": CONVERSATIONS[2]}]
    path = _columnar(tmp_path / f"bad{suffix}", rows)
    capsys.readouterr()
    code, _ = _preprocess(tmp_path, tokenizers["marked"], chats=path)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"{path}: row 3: " in err[0] and "unknown role 'bot'" in err[0], err
    assert os.listdir(tmp_path / "out") == []
    other = _columnar(tmp_path / f"other{suffix}", [{"text": "hello"}])
    code, _ = _preprocess(tmp_path, tokenizers["marked"], chats=other)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "'messages' is not in" in err[0] and other in err[0], err


# ---------------------------------------------------------------------------------------------- SFT samples


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory, tokenizers):
    """Nine conversations (three, three times) of 26 to 64 tokens, preprocessed with the marked template."""
    root = tmp_path_factory.mktemp("chat-data")
    chats = write_chats(root / "chats.jsonl", repeat=3)
    code, prefix = _preprocess(root, tokenizers["marked"], chats=chats)
    assert code == 0
    return prefix


def _expected_weights(dataset: SFTDataset, k: int, masks: IndexedDataset) -> np.ndarray:
    """Position i weighs 1 iff input i and label i + 1 are in one conversation and the label is an assistant token."""
    want, o = np.zeros(dataset.seq_length, np.float32), 0
    for doc in dataset.document_ids(k):
        mask = masks.document(doc)[:dataset.seq_length + 1]
        for t in range(1, len(mask)):
            want[o + t - 1] = mask[t]
        o += len(mask)
    return want


@pytest.mark.parametrize("s", [70, 150])
def test_sft_samples_hold_whole_conversations_and_weigh_assistant_labels_only(chat_data, s):
    indexed, masks = IndexedDataset(chat_data), IndexedDataset(chat_data + LOSS_MASK_SUFFIX)
    dataset = SFTDataset(indexed, (0, indexed.num_documents), s, 1234, 12, None, "train", SFTOptions(pad=0))
    assert len(dataset) >= 12
    seen = []
    for k in range(len(dataset)):
        tokens, weights, bounds = dataset.sft_sample(k)
        docs = dataset.document_ids(k)
        seen.extend(docs)
        o = 0
        for doc, start in zip(docs, bounds):  # each conversation whole, at its boundary
            assert start == o
            np.testing.assert_array_equal(tokens[o:o + len(indexed.document(doc))], indexed.document(doc))
            o += len(indexed.document(doc))
        assert (tokens[o:] == 0).all() and bounds[-1] == s and (o >= s or bounds[len(docs)] == o)
        np.testing.assert_array_equal(weights, _expected_weights(dataset, k, masks))
        assert weights[max(o - 1, 0):].sum() == 0  # the padding and the prediction of the next conversation
    assert sorted(set(seen)) == list(range(indexed.num_documents))  # every conversation, no one cut
    if s == 150:
        assert any(len(dataset.document_ids(k)) > 1 for k in range(len(dataset)))  # packing happens


def test_a_conversation_longer_than_the_sample_is_refused_or_truncated_with_the_flag(chat_data):
    indexed = IndexedDataset(chat_data)
    longest = int(indexed.sequence_lengths.max())
    with pytest.raises(DataError, match=r"--sft: conversation \d+ of .* more than --seq-length \+ 1 = 33.*--sft-truncate"):
        SFTDataset(indexed, (0, indexed.num_documents), 32, 1, None, None, "train", SFTOptions(pad=0))
    dataset = SFTDataset(indexed, (0, indexed.num_documents), 32, 1, None, None, "train", SFTOptions(0, True))
    masks = IndexedDataset(chat_data + LOSS_MASK_SUFFIX)
    for k in range(len(dataset)):
        tokens, weights, _ = dataset.sft_sample(k)
        np.testing.assert_array_equal(weights, _expected_weights(dataset, k, masks))
    assert longest > 33


@pytest.mark.parametrize("per_token", [False, True], ids=["megatron-default", "calculate-per-token-loss"])
def test_a_packed_sft_batch_equals_its_conversations_run_alone(chat_data, per_token):
    """Packed samples through ptdp's Llama with --sft's layout: every position's logits equal HF's on that
    conversation alone, and the step's loss is the assistant labels' cross-entropy of the conversations alone
    (per microbatch averaged, or one mean over the global batch)."""
    from ptdp.data.documents import DocumentOptions
    from ptdp.ops.document_attention import PerDocument
    from ptdp.parallel import ParallelDims, ParallelState
    from ptdp.parallel.assembly import stage_loss
    from ptdp.train.batches import BatchFormat, Microbatches

    hf, ours, _ = tiny_hf_llama_and_ours(384, 256)
    indexed = IndexedDataset(chat_data)
    masks = IndexedDataset(chat_data + LOSS_MASK_SUFFIX)
    s, m = 150, 2
    dataset = SFTDataset(indexed, (0, indexed.num_documents), s, 3, 4, None, "train", SFTOptions(pad=0))
    fmt = BatchFormat(4, 2, DocumentOptions(0, True, True, False, sft=True), PerDocument(), per_token)
    batches = Microbatches(dataset, 0, fmt, ParallelState(ParallelDims(1, 1, 1, 1), 0, torch.device("cpu")), m)
    batches.begin()
    total, sums, counts = torch.zeros(()), [], []
    with torch.no_grad():
        for j in range(m):
            out = ours(batches.inputs(j), **batches.extras(j))
            total = total + stage_loss(out.clone(), batches.labels(j), batches.loss_weights(j)) / m
            mb_sum, mb_count = 0.0, 0
            for i in range(2):
                tokens = dataset[2 * j + i]
                o = 0
                for doc in dataset.document_ids(2 * j + i):
                    conv, mask = indexed.document(doc).astype(np.int64), masks.document(doc)
                    n = len(conv)
                    alone = hf(torch.from_numpy(conv)[None]).logits[0]
                    np.testing.assert_array_equal(tokens[o:o + n], conv)
                    torch.testing.assert_close(out[i, o:o + min(n, s - o)], alone[:min(n, s - o)], rtol=1e-5, atol=1e-5)
                    ce = F.cross_entropy(alone[:-1], torch.from_numpy(conv[1:]), reduction="none")
                    mb_sum += float((ce * torch.from_numpy(mask[1:].astype(np.float32))).sum())
                    mb_count += int(mask[1:].sum())
                    o += n
            sums.append(mb_sum)
            counts.append(mb_count)
    want = sum(sums) / sum(counts) if per_token else sum(a / c for a, c in zip(sums, counts)) / m
    assert math.isclose(float(total), want, rel_tol=1e-5)


def test_samples_decode_brackets_the_loss_bearing_text(chat_data, capsys):
    capsys.readouterr()
    assert main(["samples", "--sft", "--data-path", chat_data, "--split", "100,0,0", "--num-layers", "2",
                 "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "150", "--micro-batch-size",
                 "2", "--global-batch-size", "4", "--train-iters", "2", "--decode", "--first", "3"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assistant = {m["content"] for c in CONVERSATIONS for m in c if m["role"] == "assistant"}
    for record in records:
        marked = [part.split("]]")[0] for part in record["text"].split("[[")[1:]]
        assert marked and all(t.endswith("<|im_end|>") and t[:-len("<|im_end|>")] in assistant for t in marked)
        assert record["loss_positions"] and record["cu_seqlens"][-1] == 150


def test_a_short_sft_training_run(chat_data, tmp_path, capsys):
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "150",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3",
            "--log-interval", "1", "--split", "100,0,0"]
    metrics = tmp_path / "metrics.jsonl"
    run_ptdp(["train", *base, "--sft", "--data-path", chat_data, "--calculate-per-token-loss", "--metrics-file",
              str(metrics)])
    loss = [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    assert len(loss) == 3 and all(math.isfinite(x) for x in loss)
    # a conversation longer than the sample: one line, exit 2, unless --sft-truncate
    short = [*base[:base.index("--seq-length")], "--seq-length", "32", *base[base.index("--seq-length") + 2:]]
    proc = refused_in_process(["train", *short, "--sft", "--data-path", chat_data], capsys)
    assert proc.returncode == 2 and "more than --seq-length + 1 = 33" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("flags, message", [
    (["--sft-truncate", "--data-path", "d"], "--sft-truncate applies only with --sft"),
    (["--sft"], "--sft trains on chat data: give --data-path"),
    (["--sft", "--data-path", "d", "--eod-mask-loss"], "--sft with --eod-mask-loss"),
])
def test_sft_flag_conflicts_are_one_line_each(flags, message):
    from ptdp.cli.main import build_parser
    from ptdp.config import config_from_args, validate

    errors = validate(config_from_args(build_parser().parse_args(["train", *flags])), 1)
    assert any(message in e for e in errors), errors


def test_sft_layouts_train_like_one_process(chat_data, tmp_path):
    """Data, context, tensor + sequence and pipeline parallelism and ZeRO-3 under --sft (both normalisations
    for d = 2) train like one process: the loss weights and the conversations' boundaries reach every rank's
    share of the samples (the sequence-parallel shards, the last pipeline stage, the sharded parameters)."""
    from helpers import assert_equivalent, run_layouts

    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "152",
            "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3",
            "--lr-warmup-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
            "--split", "100,0,0", "--sft", "--data-path", chat_data]
    per_token = ["--calculate-per-token-loss"]
    runs = run_layouts(tmp_path, {"one": (1, []), "d2": (2, []), "c2": (2, ["--context-parallel-size", "2"]),
                                  "t2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                                  "p2": (2, ["--pipeline-model-parallel-size", "2"]),
                                  "d2_zero3": (2, ["--data-parallel-sharding-strategy", "optim_grads_params",
                                                   "--use-distributed-optimizer"]),
                                  "one_per_token": (1, per_token), "d2_per_token": (2, per_token)}, base=base)
    assert_equivalent(runs["d2"], runs["one"])
    assert_equivalent(runs["c2"], runs["one"])
    assert_equivalent(runs["t2_sp"], runs["one"])
    assert_equivalent(runs["p2"], runs["one"])
    assert_equivalent(runs["d2_zero3"], runs["one"])
    assert_equivalent(runs["d2_per_token"], runs["one_per_token"])
    assert all(abs(a - b) > 1e-6 for a, b in zip(runs["one"].losses, runs["one_per_token"].losses))
