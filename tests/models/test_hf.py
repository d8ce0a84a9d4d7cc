"""Hugging Face GPT-2 export/import: the same function on both sides, and a lossless round trip; a GPT-2 with
the exact GeLU (``activation_function="gelu"``) trains as ``transformers`` + AdamW does in one process, at
t = 2 and at p = 2."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (
    assert_hf_track,
    hf_adamw_track,
    hf_layout_training,
    hf_train_flags,
    run_layouts,
    train_batches,
)
from helpers import track as run_track

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from ptdp.checkpointing import read_full_model_state  # noqa: E402
from ptdp.cli.main import main as ptdp_main  # noqa: E402
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


def random_hf_model(directory, vocab_size: int = 300, activation: str = "gelu_new", scale: float = 0.2):
    """A GPT-2 with every parameter random (LayerNorms and biases too), saved in fp32 safetensors."""
    config = transformers.GPT2Config(vocab_size=vocab_size, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                     n_inner=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     layer_norm_epsilon=1e-6, bos_token_id=0, eos_token_id=0,
                                     activation_function=activation)
    model = transformers.GPT2LMHeadModel(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * scale)
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


EXACT_TRAIN = hf_train_flags(16, 1e-2)


def _max_rel_diff(got: list[tuple[float, float]], want: list[tuple[float, float]]) -> float:
    return max(abs(g - w) / abs(w) for pair in zip(got, want, strict=True) for g, w in zip(*pair))


@pytest.fixture(scope="module")
def exact_gelu(tmp_path_factory):
    """An HF GPT-2 with the exact GeLU imported, trained in one process, at t = 2 and at p = 2 (one pool), and
    by HF + AdamW on the same batches; HF's track with the tanh GeLU from the same weights, to show that the
    comparison tells the two apart (weights of std 0.5: the GeLU inputs reach where the forms differ)."""
    tmp = tmp_path_factory.mktemp("exact-gelu")
    hf = random_hf_model(tmp / "hf", activation="gelu", scale=0.5)
    tanh = transformers.GPT2LMHeadModel.from_pretrained(tmp / "hf", activation_function="gelu_new")
    layouts = {"t2": (2, ["--tensor-model-parallel-size", "2"]), "p2": (2, ["--pipeline-model-parallel-size", "2"])}
    runs, hf_track, initial = hf_layout_training(tmp, hf, layouts, 300, 16)
    tanh_track = hf_adamw_track(tanh, train_batches([*EXACT_TRAIN, "--vocab-size", "300"], 3, 8), 1e-2, 300)
    return tmp, hf, runs, hf_track, initial, tanh_track


@torch.no_grad()
def test_exact_gelu_gpt2_imports_to_hf_logits_and_exports_as_gelu(exact_gelu, tmp_path):
    tmp, _, _, _, initial, _ = exact_gelu
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp / "hf").eval()
    tensors, config = read_full_model_state(tmp / "imported")
    assert config["model"]["bias_gelu_fusion"] is False  # GPT-2 has biases: the exact GeLU is the unfused one
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(2))
    want = hf(tokens).logits
    exact = (full_model_from_state(tensors, config)(tokens)[..., :300] - want).abs().max()
    tanh_model = full_model_from_state(tensors, {**config, "model": {**config["model"], "bias_gelu_fusion": True}})
    tanh = (tanh_model(tokens)[..., :300] - want).abs().max()
    assert exact < 1e-5 and tanh > 10 * exact, (exact, tanh)  # HF's function, and not the tanh one's
    assert ptdp_main(["export", "--load", str(tmp / "imported"), "--out", str(tmp_path / "back")]) == 0
    assert json.loads((tmp_path / "back" / "config.json").read_text())["activation_function"] == "gelu"
    back = safetensors_torch.load_file(tmp_path / "back" / "model.safetensors")
    assert back and all(torch.equal(value, initial[name]) for name, value in back.items())  # bit for bit


@pytest.mark.parametrize("layout", ["one", "t2", "p2"])
def test_exact_gelu_gpt2_trains_as_hf_and_adamw_per_iteration(exact_gelu, layout):
    _, _, runs, hf_track, _, tanh_track = exact_gelu
    assert_hf_track(runs[layout], hf_track)
    # fp32 agrees to ~1e-7; the tanh GeLU's track is >= 1e-5 away from the exact one's
    got = run_track(runs[layout].records)
    assert _max_rel_diff(got, hf_track) < 2e-6 < 1e-5 < _max_rel_diff(tanh_track, hf_track)
    # (no weight comparison: the key bias's gradient is zero up to rounding, which AdamW scales to lr-sized
    # steps of either sign on each side)


def test_import_rejects_other_architectures_in_one_line(tmp_path, capsys):
    random_hf_model(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["activation_function"] = "relu"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert ptdp_main(["import", "--in", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "ptdp import: error: --in: config.json has activation_function='relu'; ptdp's GPT needs gelu_new, gelu_pytorch_tanh or gelu"]
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("args,flag", [
    (["export", "--load", "{tmp}/nothing", "--out", "{tmp}/out"], "--load"),
    (["import", "--in", "{tmp}/nothing", "--save", "{tmp}/ckpt"], "--in"),
])
def test_bad_paths_are_one_line_errors(tmp_path, capsys, args, flag):
    assert ptdp_main([a.format(tmp=tmp_path) for a in args]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"ptdp {args[0]}: error: {flag}"), err
