"""Hugging Face Llama round trip: a small random ``LlamaForCausalLM`` built locally (no hub) imports into a
ptdp checkpoint that computes HF's logits, exports back to HF's exact tensors, and decodes greedily to the
same tokens. Covers GQA, an untied lm_head, rope_theta, the llama3 rope scaling, head_dim != h/a, and a
tied MHA variant; unsupported variants are refused with one line."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import assert_export_equals_hf_files, assert_reload_equals_hf, hf_import

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from ptdp.cli.main import main  # noqa: E402
from ptdp.hf.convert import import_hf  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
VARIANTS = {
    # Llama 3.1-like: GQA (4 query heads, 2 groups), untied lm_head, theta 5e5, llama3 scaling
    "gqa_untied_llama3": dict(num_key_value_heads=2, tie_word_embeddings=False, rope_theta=500000.0,
                              rope_scaling=LLAMA3),
    # Llama 2-like: MHA, tied embeddings, theta 1e4, a head dimension other than h/a
    "mha_tied_head_dim": dict(num_key_value_heads=4, tie_word_embeddings=True, rope_theta=10000.0, head_dim=8),
}


def hf_llama(tmp_path, variant: str):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=None,
        eos_token_id=None, pad_token_id=None, **VARIANTS[variant])
    model = transformers.LlamaForCausalLM(config).eval()
    directory = tmp_path / "hf"
    model.save_pretrained(str(directory), safe_serialization=True)
    return model, directory


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_llama_import_logits_export_and_greedy_generation(tmp_path, variant):
    hf, directory = hf_llama(tmp_path, variant)
    ours, _, _ = hf_import(tmp_path, directory)
    m = ours.cfg
    assert m.untie_embeddings_and_output_weights == (variant == "gqa_untied_llama3")
    assert m.use_rope_scaling == (variant == "gqa_untied_llama3")

    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)[..., :300]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)

    saved = assert_export_equals_hf_files(tmp_path / "ckpt", tmp_path / "out", directory)
    assert saved["model_type"] == "llama" and saved["num_key_value_heads"] == hf.config.num_key_value_heads
    assert_reload_equals_hf(tmp_path / "out", tokens, expected, atol=1e-6, ours=ours, new_tokens=12)


@pytest.mark.parametrize("change,fragment", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope scaling type 'linear'"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"sliding_window": 16}, "sliding attention window"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
])
def test_unsupported_llama_variants_are_refused(tmp_path, capsys, change, fragment):
    _, directory = hf_llama(tmp_path, "gqa_untied_llama3")
    config = json.loads((directory / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.update(change)
    (directory / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # drop save_pretrained's progress bars
    assert main(["import", "--format", "hf", "--in", str(directory), "--save", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


def llama_style_tokenizer(path) -> str:
    """A Llama-2-style tokenizer.json trained here: <unk>, <s> (BOS), </s> (EOS), a "<s> $A" template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([f"def f{k}(x):\n    return x * {k}\n" for k in range(200)], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path))
    return str(path)


def test_llama_tokenizer_file_in_preprocess_and_generate(tmp_path, capsys):
    """BOS/EOS come from the file: documents are <s> text </s>; `ptdp generate --tokenizer-file` encodes the
    prompt the same way and decodes what HF's greedy search picks."""

    from ptdp.cli.generate import generate_text
    from ptdp.data import IndexedDataset

    tok_file = llama_style_tokenizer(tmp_path / "tokenizer.json")
    texts = ["def f1(x):\n    return x * 1\n", "def g(y): return y"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "data"),
                 "--tokenizer-file", tok_file]) == 0
    from tokenizers import Tokenizer

    hf_tok = Tokenizer.from_file(tok_file)
    bos, eos = hf_tok.token_to_id("<s>"), hf_tok.token_to_id("</s>")
    for k, text in enumerate(texts):
        ids = hf_tok.encode(text, add_special_tokens=False).ids
        assert IndexedDataset(str(tmp_path / "data")).document(k).tolist() == [bos, *ids, eos]

    hf, directory = hf_llama(tmp_path, "gqa_untied_llama3")  # vocabulary 300 = the tokenizer's
    import_hf(directory, tmp_path / "ckpt")
    capsys.readouterr()
    from ptdp.cli.main import build_parser

    args = build_parser().parse_args(["generate", "--load", str(tmp_path / "ckpt"), "--prompt", "def f",
                                      "--max-new-tokens", "6", "--greedy", "--tokenizer-file", tok_file])
    text = generate_text(args)
    prompt_ids = [bos, *hf_tok.encode("def f", add_special_tokens=False).ids]
    with torch.no_grad():
        hf_ids = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=6, do_sample=False, min_new_tokens=6)
    new = hf_ids[0, len(prompt_ids):].tolist()
    new = new[: new.index(eos) + 1] if eos in new else new  # ptdp stops at EOS (HF here does not)
    assert text == "def f" + hf_tok.decode(new, skip_special_tokens=True)
