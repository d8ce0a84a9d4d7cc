"""Hugging Face GPT-2 export/import: the same function on both sides, and a lossless round trip."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import run_layouts

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from ptdp.checkpointing import read_full_model_state  # noqa: E402
from ptdp.cli.main import main as ptdp_main  # noqa: E402
from ptdp.data import build_datasets, get_microbatch  # noqa: E402
from ptdp.hf.convert import full_model_from_state  # noqa: E402

VOCAB = 257  # the byte tokenizer of the default corpus


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory):
    """A checkpoint trained and saved in the (t, p) = (2, 2) layout."""
    root = tmp_path_factory.mktemp("tp2pp2")
    save = root / "ckpt"
    run_layouts(root, {"t2p2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                    "--save", str(save)])})
    info = json.loads((save / "iter_0000003" / "ptdp.json").read_text())
    layout = info["layout"]
    assert (layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"]) == (2, 2)
    return save


@pytest.fixture(scope="module")
def exported(sharded_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    assert ptdp_main(["export", "--load", str(sharded_checkpoint), "--format", "hf", "--out", str(out)]) == 0
    return out


def ptdp_greedy(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    tokens = prompt
    for _ in range(new_tokens):
        next_id = model(tokens)[:, -1, :VOCAB].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, next_id], dim=1)
    return tokens


@torch.no_grad()
def test_export_from_tp2_pp2_gives_ptdp_logits_and_greedy_text(sharded_checkpoint, exported):
    tensors, config = read_full_model_state(sharded_checkpoint)
    ours = full_model_from_state(tensors, config)
    hf = transformers.GPT2LMHeadModel.from_pretrained(exported).eval()
    hf_config = json.loads((exported / "config.json").read_text())
    assert (hf_config["vocab_size"], hf_config["n_positions"], hf_config["activation_function"]) == \
        (VOCAB, 16, "gelu_new")
    assert hf_config["eos_token_id"] == 256  # the byte tokenizer's end-of-document id, unchanged
    tokens = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(0))
    our_logits = ours(tokens)
    assert torch.isneginf(our_logits[..., VOCAB:]).all()  # ptdp's padding rows, dropped by the export
    torch.testing.assert_close(hf(tokens).logits, our_logits[..., :VOCAB], rtol=1e-5, atol=1e-5)

    prompt = torch.tensor([list(b"def ma")])
    expected = ptdp_greedy(ours, prompt, 10)
    got = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False,
                      pad_token_id=256)
    assert got.tolist() == expected.tolist()


def random_hf_model(directory, vocab_size: int = 300):
    """A GPT-2 with every parameter random (LayerNorms and biases too), saved in fp32 safetensors."""
    config = transformers.GPT2Config(vocab_size=vocab_size, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                     n_inner=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     layer_norm_epsilon=1e-6, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    model.save_pretrained(directory)
    return model


@torch.no_grad()
def test_import_then_export_is_the_identity(tmp_path):
    original = random_hf_model(tmp_path / "hf")
    assert ptdp_main(["import", "--format", "hf", "--in", str(tmp_path / "hf"),
                      "--save", str(tmp_path / "ckpt")]) == 0
    tensors, config = read_full_model_state(tmp_path / "ckpt")
    embedding = tensors["embedding.word_embeddings.weight"]
    assert embedding.shape == (384, 32) and not embedding[300:].any()  # padded as ptdp pads, with zeros
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(full_model_from_state(tensors, config)(tokens)[..., :300],
                               original(tokens).logits, rtol=1e-5, atol=1e-5)

    assert ptdp_main(["export", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back")]) == 0
    before = safetensors_torch.load_file(tmp_path / "hf" / "model.safetensors")
    after = safetensors_torch.load_file(tmp_path / "back" / "model.safetensors")
    before.pop("lm_head.weight", None)  # tied to wte; HF may or may not store it
    assert before.keys() == after.keys()
    for name, value in before.items():
        assert after[name].dtype == value.dtype and after[name].shape == value.shape, name
        assert after[name].numpy().tobytes() == value.numpy().tobytes(), name


def test_imported_model_trains_in_pp2_from_the_hf_loss(tmp_path):
    """Continue training an imported GPT-2 in another layout: its first loss is HF's loss on that batch."""
    original = random_hf_model(tmp_path / "hf", vocab_size=VOCAB)
    assert ptdp_main(["import", "--in", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 0
    shape = ["--num-layers", "2", "--ffn-hidden-size", "64", "--layernorm-epsilon", "1e-6"]
    records = run_layouts(tmp_path / "runs", {"p2": (2, [*shape, "--load", str(tmp_path / "ckpt"), "--train-iters",
                                                         "1", "--pipeline-model-parallel-size", "2"])})["p2"].records
    data = build_datasets(None, "969,30,1", 16, 1234)
    batch = torch.cat([get_microbatch(data.train, 0, 16, 0, 1, 2, j) for j in range(8)])
    with torch.no_grad():
        logits = original(batch[:, :-1]).logits
    hf_loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1)).item()
    assert records[0]["loss"] == pytest.approx(hf_loss, rel=1e-5)


def test_import_rejects_other_architectures_in_one_line(tmp_path, capsys):
    random_hf_model(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["activation_function"] = "relu"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert ptdp_main(["import", "--in", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "ptdp import: error: --in: config.json has activation_function='relu'; ptdp's GPT needs gelu_new"]
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("args,flag", [
    (["export", "--load", "{tmp}/nothing", "--out", "{tmp}/out"], "--load"),
    (["import", "--in", "{tmp}/nothing", "--save", "{tmp}/ckpt"], "--in"),
])
def test_bad_paths_are_one_line_errors(tmp_path, capsys, args, flag):
    assert ptdp_main([a.format(tmp=tmp_path) for a in args]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"ptdp {args[0]}: error: {flag}"), err
