"""``ptdp train --sft`` against transformers: a random tiny Qwen3 with a chat template, imported with ``ptdp
import --format hf``, trained 3 iterations on chat data that ``ptdp preprocess --sft`` prepared; the same
conversations trained in transformers -- rendered by ``apply_chat_template`` with its assistant tokens mask
(labels -100 outside it), each conversation alone (a packed sample computes exactly what its conversations
alone would: tests/finetune/test_sft_data.py), grouped into the microbatches and global batches of ptdp's packed
samples -- under ``torch.optim.AdamW``: the loss and gradient norm of every iteration are equal, with
Megatron's per-microbatch mean and with ``--calculate-per-token-loss``. ``ptdp generate --chat`` on the
imported model: the ids it feeds are ``apply_chat_template(add_generation_prompt=True)``'s, its greedy answer
is transformers' greedy ``generate`` with the template's end-of-turn id, and bad input is one line."""

from __future__ import annotations

import json
import shlex

import pytest
import torch
import torch.nn.functional as F
from helpers import run_layouts, validated_config
from sft_helpers import CONVERSATIONS, MARKED, chat_tokenizer, write_chats

transformers = pytest.importorskip("transformers")

from ptdp.cli.main import main  # noqa: E402

V = 300  # the tokenizer's vocabulary (trained to 300) is the model's
MICRO, GLOBAL, ITERS, SEQ = 2, 4, 3, 150
TRAIN = ["--micro-batch-size", str(MICRO), "--global-batch-size", str(GLOBAL), "--train-iters", str(ITERS),
         "--lr", "1e-2", "--lr-warmup-iters", "0", "--lr-decay-style", "constant", "--weight-decay", "0",
         "--clip-grad", "1.0", "--hidden-dropout", "0", "--attention-dropout", "0", "--seq-length", str(SEQ),
         "--log-interval", "1", "--split", "100,0,0", "--sft"]


def _hf_model(directory):
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.Qwen3ForCausalLM(config).float().eval()
    model.save_pretrained(str(directory), safe_serialization=True)
    return model


def _sample_conversations(args: list[str]) -> list[list[list[int]]]:
    """Per global batch, per sample (in ptdp's order), the conversations (row numbers) it packs."""
    from ptdp.data.training_data import datasets_for_config

    stream = datasets_for_config(validated_config(args)).train
    out = []
    for k in range(ITERS):
        batch = []
        for i in range(k * GLOBAL, (k + 1) * GLOBAL):
            dataset, j = stream.locate(i)
            batch.append(dataset.document_ids(j))
        out.append(batch)
    return out


def _hf_training(hf, tokenizer, batches: list[list[list[int]]], per_token: bool) -> list[tuple[float, float]]:
    """(loss, gradient norm) per iteration of transformers + AdamW on the conversations of ptdp's batches."""
    rendered = [tokenizer.apply_chat_template(c, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
                for c in CONVERSATIONS]
    examples = []
    for r in rendered:
        ids = torch.tensor(list(r["input_ids"]))
        labels = torch.where(torch.tensor(list(r["assistant_masks"])) == 1, ids, torch.full_like(ids, -100))
        examples.append((ids, labels))
    hf.train()
    optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-2, weight_decay=0.0)
    track = []
    for batch in batches:
        optimizer.zero_grad()
        sums, counts = [], []
        for m in range(0, GLOBAL, MICRO):  # one process: the microbatches are consecutive samples
            total, count = torch.zeros(()), 0
            for sample in batch[m:m + MICRO]:
                for row in sample:
                    ids, labels = examples[row % len(CONVERSATIONS)]  # write_chats repeats the conversations
                    logits = hf(ids[None]).logits[0, :-1]
                    total = total + F.cross_entropy(logits, labels[1:], ignore_index=-100, reduction="sum")
                    count += int((labels[1:] != -100).sum())
            sums.append(total)
            counts.append(count)
        loss = sum(sums) / sum(counts) if per_token else sum(s / c for s, c in zip(sums, counts)) / len(sums)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        optimizer.step()
        track.append((loss.item(), norm.item()))
    return track


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft-hf")
    tok = chat_tokenizer(tmp / "tok", MARKED)
    hf = _hf_model(tmp / "hf")
    assert main(["import", "--format", "hf", "--in", str(tmp / "hf"), "--save", str(tmp / "imported")]) == 0
    chats = write_chats(tmp / "chats.jsonl", repeat=3)
    prefix = str(tmp / "data" / "chat")
    assert main(["preprocess", "--input", chats, "--output-prefix", prefix, "--sft", "--tokenizer-type",
                 "HuggingFaceTokenizer", "--tokenizer-model", tok]) == 0
    return tmp, tok, hf, prefix


def test_sft_training_equals_transformers_with_its_assistant_mask_and_adamw(setup, capsys):
    from ptdp.hf.convert import import_hf_model, train_flags

    tmp, tok, hf, prefix = setup
    _, cfg, moe = import_hf_model(tmp / "hf", tmp / "reimported")  # the flags the import command printed
    base = [*shlex.split(train_flags(cfg, moe)), "--vocab-size", str(V), *TRAIN, "--data-path", prefix,
            "--load", str(tmp / "imported")]
    runs = run_layouts(tmp / "runs", {"mean": (1, []), "per_token": (1, ["--calculate-per-token-loss"])},
                       base=base, save=False)
    batches = _sample_conversations(base)
    assert any(len(sample) > 1 for batch in batches for sample in batch)  # samples pack several conversations
    tokenizer = transformers.AutoTokenizer.from_pretrained(tok)
    initial = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    for name, per_token in (("mean", False), ("per_token", True)):
        hf.load_state_dict(initial)
        track = _hf_training(hf, tokenizer, batches, per_token)
        got = [(r["loss"], r["grad_norm"]) for r in runs[name].records]
        assert len(got) == len(track) == ITERS
        for (loss, norm), (want_loss, want_norm) in zip(got, track):
            assert loss == pytest.approx(want_loss, rel=1e-5), (name, got, track)
            assert norm == pytest.approx(want_norm, rel=1e-4), (name, got, track)
        assert track[0][0] != pytest.approx(track[-1][0], rel=1e-3)  # the model trained: the comparison bites
    assert runs["mean"].records[0]["loss"] != pytest.approx(runs["per_token"].records[0]["loss"], rel=1e-6)


# ---------------------------------------------------------------------------------------------- generate --chat


def _chat(capsys, monkeypatch, tmp, tok, *flags: str) -> tuple[int, str, str, list]:
    """``ptdp generate --chat`` in this process; also the (prompt ids, new ids) of each decode it ran."""
    import ptdp.cli.generate as gen

    calls, real = [], gen.generate

    def spy(model, tokenizer, prompt_ids, *args, **kwargs):
        new = real(model, tokenizer, prompt_ids, *args, **kwargs)
        calls.append((list(prompt_ids), new, kwargs.get("stop_ids")))
        return new

    monkeypatch.setattr(gen, "generate", spy)
    capsys.readouterr()
    code = main(["generate", "--load", str(tmp / "imported"), "--chat", "--tokenizer-type", "HuggingFaceTokenizer",
                 "--tokenizer-model", tok, *flags])
    out, err = capsys.readouterr()
    return code, out, err, calls


def test_generate_chat_feeds_apply_chat_template_and_answers_as_hf_greedy(setup, capsys, monkeypatch):
    tmp, tok, _, _ = setup
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp / "hf")).float().eval()  # untrained weights
    tokenizer = transformers.AutoTokenizer.from_pretrained(tok)
    im_end, eos = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "1 + 2?"}]
    code, out, err, calls = _chat(capsys, monkeypatch, tmp, tok, "--system", messages[0]["content"], "--prompt",
                                  messages[1]["content"], "--greedy", "--max-new-tokens", "6")
    assert code == 0, err
    [(prompt_ids, new, stops)] = calls
    want = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True)
    assert prompt_ids == list(want["input_ids"]) and tokenizer.decode(prompt_ids).endswith("<|im_start|>assistant\n")
    assert stops == [im_end, eos]  # the template's end of turn, then eos
    with torch.no_grad():
        reference = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=6, do_sample=False,
                                eos_token_id=stops, pad_token_id=eos)[0, len(prompt_ids):].tolist()
    assert new == reference and len(new) == 6
    assert out == tokenizer.decode([i for i in new if i not in stops]) + "\n"
    # --messages FILE (a row of the SFT data) renders the same prompt
    row = tmp / "row.json"
    row.write_text(json.dumps({"messages": messages}))
    code, out2, _, calls = _chat(capsys, monkeypatch, tmp, tok, "--messages", str(row), "--greedy",
                                 "--max-new-tokens", "6")
    assert code == 0 and calls[0][0] == prompt_ids and out2 == out


def test_generate_stops_at_the_end_of_turn_id():
    """The first greedy token made a stop id: one token generated, then the loop ends."""
    from ptdp.cli.generate import generate
    from ptdp.config import ModelConfig
    from ptdp.models import GPTModel

    torch.manual_seed(0)
    model = GPTModel(ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=16), 64, 64)
    free = generate(model, None, [1, 2, 3], 5)
    assert len(free) == 5
    assert generate(model, None, [1, 2, 3], 5, stop_ids=[free[0]]) == free[:1]


@pytest.mark.parametrize("flags, message", [
    (["--chat", "--prompt", "hi"], "--chat renders the model's chat template: give --tokenizer-type"),
    (["--system", "x", "--prompt", "hi"], "--system applies only with --chat"),
    (["--chat", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "TOK"],
     "--chat needs --prompt TEXT"),
    (["--chat", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "TOK", "--messages", "BAD"],
     "--messages BAD: message 2 has the unknown role 'bot'"),
    (["--chat", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "NONE", "--prompt", "hi"],
     "has no chat template"),
])
def test_generate_chat_bad_input_is_one_line_exit_2(setup, capsys, tmp_path, flags, message):
    tmp, tok, _, _ = setup
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]))
    none = chat_tokenizer(tmp_path / "none", None) if "NONE" in flags else ""
    flags = [{"TOK": tok, "BAD": str(bad), "NONE": none}.get(f, f) for f in flags]
    message = message.replace("BAD", str(bad))
    capsys.readouterr()
    code = main(["generate", "--load", str(tmp / "imported"), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
