"""``ptdp generate``: deterministic greedy and seeded sampling from real training checkpoints, the same
text from a t=2 x p=2 checkpoint as from a single-process one, eod/length stops, context cropping,
invalid UTF-8 replaced, and one clear line for bad input."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_equivalent, run_layouts, worker_env

from ptdp.checkpointing import read_full_model_state, storage, write_full_model_state
from ptdp.cli.generate import generate, sample
from ptdp.cli.main import main as ptdp_main
from ptdp.config import ModelConfig
from ptdp.data import ByteTokenizer
from ptdp.hf.convert import full_model_from_state
from ptdp.models import GPTModel

PROMPT = "def main("
VOCAB = ByteTokenizer.vocab_size


@pytest.fixture(autouse=True)
def one_thread():
    """Generation runs in this process: one thread, as each worker has (2 shared cores oversubscribe)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, reference) -> dict:
    """The same 3 training iterations saved by one process (the session's reference) and by t=2 x p=2."""
    root = tmp_path_factory.mktemp("generate")
    tp_pp = run_layouts(root, {"tp2pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                                              "2", "--save", str(root / "tp2pp2")])})["tp2pp2"]
    return {"serial": reference.ckpt, "tp2pp2": tp_pp.ckpt, "runs": (reference, tp_pp)}


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = ptdp_main(["generate", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def load(path) -> GPTModel:
    return full_model_from_state(*read_full_model_state(path))


def test_greedy_is_deterministic_and_continues_the_prompt(checkpoints, capsys):
    args = ["--load", str(checkpoints["serial"]), "--prompt", PROMPT, "--greedy", "--max-new-tokens", "12"]
    first, second = cli(capsys, *args), cli(capsys, *args)
    assert first == second and first[0] == 0
    ids = generate(load(checkpoints["serial"]), ByteTokenizer(), ByteTokenizer().encode(PROMPT), 12)
    assert 0 < len(ids) <= 12 and (len(ids) == 12 or ids[-1] == ByteTokenizer.eod_id)
    assert first[1] == PROMPT + ByteTokenizer().decode(ids) + "\n"


def test_sampling_is_deterministic_per_seed(checkpoints, capsys):
    base = ["--load", str(checkpoints["serial"]), "--prompt", PROMPT, "--max-new-tokens", "24",
            "--temperature", "1.0"]
    a, b = cli(capsys, *base, "--seed", "1"), cli(capsys, *base, "--seed", "1")
    c = cli(capsys, *base, "--seed", "2")
    assert a == b and a[0] == 0 and a[1].startswith(PROMPT)
    assert c[1] != a[1]  # 24 draws from a barely trained, near-uniform model


def test_sampling_filters_that_keep_one_token_are_greedy(checkpoints):
    model, tok = load(checkpoints["serial"]), ByteTokenizer()
    prompt = tok.encode(PROMPT)
    greedy = generate(model, tok, prompt, 10)
    for top_k, top_p in ((1, 1.0), (0, 1e-6)):
        generator = torch.Generator().manual_seed(0)
        assert generate(model, tok, prompt, 10, greedy=False, top_k=top_k, top_p=top_p,
                        generator=generator) == greedy
    # a low temperature sharpens towards the arg-max too, while temperature 1 wanders off
    sharp = generate(model, tok, prompt, 10, greedy=False, temperature=1e-4, generator=torch.Generator())
    assert sharp == greedy


def test_sampling_draws_only_inside_top_k_and_top_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    generator = torch.Generator().manual_seed(0)

    def draws(**kw) -> set[int]:
        return {sample(logits, generator=generator, **kw) for _ in range(300)}

    assert draws(temperature=1.0, top_k=0, top_p=1.0) == {0, 1, 2, 3}
    assert draws(temperature=1.0, top_k=2, top_p=1.0) == {0, 1}
    assert draws(temperature=1.0, top_k=0, top_p=0.7) == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3
    assert draws(temperature=1.0, top_k=0, top_p=0.85) == {0, 1, 2}
    assert draws(temperature=1.0, top_k=3, top_p=0.5) == {0}


def test_context_longer_than_seq_length_keeps_its_last_tokens(checkpoints, capsys):
    model, tok = load(checkpoints["serial"]), ByteTokenizer()
    long_prompt = tok.encode("import os\nimport sys\n\n\nclass Parser(object):\n    def ")
    seq_length = model.cfg.seq_length
    assert len(long_prompt) > seq_length
    assert generate(model, tok, long_prompt, 8) == generate(model, tok, long_prompt[-seq_length:], 8)
    code, out, _ = cli(capsys, "--load", str(checkpoints["serial"]), "--prompt", "x" * 3 * seq_length,
                       "--greedy", "--max-new-tokens", str(2 * seq_length))
    assert code == 0 and out.startswith("x" * 3 * seq_length)


def test_checkpoint_from_tp2_pp2_generates_the_serial_text(checkpoints, capsys):
    serial, tp_pp = checkpoints["runs"]
    assert tp_pp.losses == pytest.approx(serial.losses, rel=1e-5)
    assert_equivalent(tp_pp, serial, 1e-4)  # gradient norms and weights too, to fp32 order
    tok = ByteTokenizer()
    ids = [generate(load(checkpoints[k]), tok, tok.encode(PROMPT), 16) for k in ("serial", "tp2pp2")]
    assert ids[0] == ids[1]
    texts = [cli(capsys, "--load", str(checkpoints[k]), "--prompt", PROMPT, "--greedy", "--max-new-tokens", "16")[1]
             for k in ("serial", "tp2pp2")]
    assert texts[0] == texts[1]


def constant_model_checkpoint(path, token: int) -> None:
    """A one-layer model whose next token is always ``token``: every weight is zero, except that the
    final LayerNorm's bias equals ``token``'s embedding row, so that row's logit is the only non-zero one."""
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8, hidden_dropout=0.0,
                      attention_dropout=0.0, vocab_size=VOCAB)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in GPTModel(cfg, VOCAB, cfg.padded_vocab_size(VOCAB, 1)).named_parameters()}
    tensors = {name: torch.zeros(shape) for name, shape in shapes.items()}
    tensors["embedding.word_embeddings.weight"][token] = 1.0
    tensors["final_layernorm.bias"][:] = 1.0
    write_full_model_state(path, tensors, {"model": {**cfg.__dict__}})


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """A real ``ptdp generate`` process: its stdout bytes are what a terminal or pipe receives."""
    return subprocess.run([sys.executable, "-m", "ptdp", "generate", *args], capture_output=True, timeout=120,
                          env={**worker_env(), "LC_ALL": "C", "LANG": "C"})


def test_invalid_utf8_is_replaced_and_eod_stops(tmp_path, capsys):
    constant_model_checkpoint(tmp_path / "ff", 0xFF)  # never a valid UTF-8 byte
    proc = run_cli("--load", str(tmp_path / "ff"), "--prompt", "héllo", "--greedy", "--max-new-tokens", "5")
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert proc.stdout == ("héllo" + "\ufffd" * 5 + "\n").encode()

    constant_model_checkpoint(tmp_path / "eod", ByteTokenizer.eod_id)
    model = load(tmp_path / "eod")
    assert generate(model, ByteTokenizer(), [104, 105], 5) == [ByteTokenizer.eod_id]
    assert generate(model, None, [104, 105], 5) == [ByteTokenizer.eod_id] * 5  # no tokenizer: no early stop
    assert cli(capsys, "--load", str(tmp_path / "eod"), "--prompt", "hi", "--seed", "3") == (0, "hi\n", "")


def checkpoint_without_model(root) -> None:
    tmp = storage.prepare_temporary(root, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"rng.seed": torch.zeros(2)}, checkpoint_id=tmp, no_dist=True)
    storage.write_info(tmp, {"iteration": 1, "contents": ["rng"], "config": {"model": {}}, "model": {"vocab_size": VOCAB}})
    storage.commit(root, 1)


@pytest.mark.parametrize("args, fragment", [
    ([], "--load is required"),
    (["--load", "{tmp}/nowhere"], "--load"),
    (["--load", "{tmp}/nomodel"], "holds no model weights"),
    (["--load", "{tmp}/nomodel", "--greedy", "--temperature", "0.5"], "--greedy and --temperature"),
    (["--load", "{tmp}/nomodel", "--top-p", "0"], "--top-p"),
    (["--load", "{tmp}/nomodel", "--temperature", "0"], "--temperature"),
    (["--load", "{tmp}/nomodel", "--max-new-tokens", "-1"], "--max-new-tokens"),
])
def test_bad_input_is_one_line(tmp_path, capsys, args, fragment):
    checkpoint_without_model(tmp_path / "nomodel")
    code, out, err = cli(capsys, *[a.format(tmp=tmp_path) for a in args])
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("ptdp generate: error:") and fragment in err, err
