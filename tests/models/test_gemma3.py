"""Gemma 3 text (``Gemma3ForCausalLM``), imported from a random Hugging Face model built here (no hub): 4 layers,
three of them sliding windows of 8 tokens and one global, at a sequence of 32 -- so the windows bite. Import
gives HF's logits, export loads back in ``transformers`` bit for bit, ``ptdp train`` in one process and at
t = 2 with sequence parallelism and p = 2, at c = 2 (p2p and all-to-all), under the interleaved, zero-bubble
(ZB-H1, with ZeRO-3 at d = 2) and V (v-min) schedules, equals ``transformers`` +
``torch.optim.AdamW`` per iteration (loss and gradient norm) on the same batches, and the one-process run's final
weights equal HF's. Also: the windowed attention core against a naive masked softmax, and the combinations the
configuration refuses."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    assert_export_equals_hf_files,
    assert_reload_equals_hf,
    config_errors,
    hf_family_tests,
    save_with_norms_off_init,
)

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from ptdp.checkpointing import read_full_model_state  # noqa: E402
from ptdp.config import Config, validate  # noqa: E402
from ptdp.hf.convert import full_model_from_state, import_hf_model  # noqa: E402
from ptdp.models.layers import CausalAttention, window_mask  # noqa: E402

V, S, W = 300, 32, 8
KINDS = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
LAYOUTS = {"t2-sp-p2": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                            "--pipeline-model-parallel-size", "2"]),
           # the windows cross the CP chunks (8 tokens each): the windowed exchange, and Ulysses
           "c2-p2p": (2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
           "c2-a2a": (2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
           # the schedules beyond 1F1B (a window per virtual stage: one layer each) and ZeRO-3's gathered weights
           "p2-interleaved": (2, ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size",
                                  "2", "--pipeline-schedule", "interleaved"]),
           "p2-zbh1-d2-zero3": (4, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1",
                                    "--data-parallel-sharding-strategy", "optim_grads_params"]),
           "p2-vmin": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "v-min"])}


def hf_model(directory):
    """A random Gemma 3 whose norms are away from their zero init (so that the 1 + w and every norm matter)."""
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=len(KINDS), num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=4096, initializer_range=0.1, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, sliding_window=W, query_pre_attn_scalar=20,
        layer_types=KINDS, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    return save_with_norms_off_init(transformers.Gemma3ForCausalLM(config), directory)


def test_import_gives_hf_logits_and_export_loads_back_bit_for_bit(tmp_path):
    hf = hf_model(tmp_path / "hf")
    _, cfg, _ = import_hf_model(tmp_path / "hf", tmp_path / "ckpt")
    assert (cfg.window_size, cfg.window_attn_skip_freq, cfg.local_rotary_base, cfg.rotary_base) == (
        W, "[1,0,1,1]", 1e4, 1e6)
    assert cfg.geglu and cfg.sandwich_norm and cfg.apply_layernorm_1p and cfg.scale_embedding and cfg.qk_layernorm
    assert cfg.softmax_scale == 20 ** -0.5 and cfg.tied_embeddings
    ours = full_model_from_state(*read_full_model_state(tmp_path / "ckpt"))
    tokens = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        torch.testing.assert_close(ours(tokens)[..., :V], expected, rtol=0, atol=1e-5)
        # the windows bite: the same model attending to the whole context computes other logits
        full = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **{**hf.config.to_dict(), "layer_types": ["full_attention"] * len(KINDS)})).eval()
        full.load_state_dict(hf.state_dict())
        assert not torch.allclose(full(tokens).logits, expected, atol=1e-3)

    saved = assert_export_equals_hf_files(tmp_path / "ckpt", tmp_path / "out", tmp_path / "hf")
    assert saved["model_type"] == "gemma3_text" and saved["layer_types"] == KINDS and saved["sliding_window"] == W
    assert saved["query_pre_attn_scalar"] == 20
    assert_reload_equals_hf(tmp_path / "out", tokens, expected)


@pytest.mark.parametrize("field,value", [("attn_logit_softcapping", 0.0), ("final_logit_softcapping", -30.0),
                                         ("rope_scaling", {"rope_type": "linear", "factor": 8.0}),
                                         ("use_bidirectional_attention", True)])
def test_import_refuses_what_it_does_not_compute_in_one_line_naming_the_field(field, value):
    from ptdp.config import ConfigError
    from ptdp.models.gemma3 import hf

    config = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96,
              "max_position_embeddings": 64, "vocab_size": V, "sliding_window": 8, field: value}
    with pytest.raises(ConfigError, match=field) as info:
        hf.read_gemma3(config, {})
    assert "\n" not in str(info.value)


(trained, test_one_process_equals_hf_and_adamw_per_iteration_and_in_its_weights,
 test_layout_equals_hf_and_adamw_per_iteration) = hf_family_tests("gemma3", hf_model, LAYOUTS, V, S)


@pytest.mark.parametrize("window", [1, 3, 8, 40])
def test_windowed_attention_equals_a_naive_masked_softmax(window):
    """Query i sees keys i - w < j <= i (HF's ``kv_idx > q_idx - sliding_window`` and causal), as a plain
    softmax over the allowed scores computes it; a window of at least s is plain causal attention."""
    g = torch.Generator().manual_seed(window)
    q, k, v = (torch.randn(2, 3, 24, 16, generator=g, dtype=torch.float64) for _ in range(3))
    scale = 0.3
    got = CausalAttention(window)(q, k, v, 0.0, scale=scale)
    i, j = torch.arange(24)[:, None], torch.arange(24)[None, :]
    allowed = (j <= i) & (i - j < window)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    torch.testing.assert_close(got, scores.softmax(-1) @ v, rtol=1e-10, atol=1e-12)
    assert torch.equal(window_mask(24, window, torch.device("cpu")), allowed)
    assert int(allowed[20].sum()) == min(window, 21)  # the window counts the token itself


@pytest.mark.parametrize("world,overrides,line", [
    (1, {"window_size": 0}, "--window-size must be a positive integer"),
    (1, {"window_attn_skip_freq": "[1,0]"}, "--window-attn-skip-freq"),
])
def test_windows_refuse_what_they_do_not_compute_in_one_line(world, overrides, line):
    errors = config_errors(world, **{"window_size": 4, **overrides})
    assert any(e.startswith(line) for e in errors), errors
    assert all("\n" not in e for e in errors)


def test_tiny_gemma3_preset_validates_and_its_layers_alternate():
    from ptdp.config.presets import MODEL_PRESETS
    from ptdp.config.validate_window import window_layers
    from ptdp.models import GPTModel

    config = Config()
    for key, value in MODEL_PRESETS["tiny-gemma3"].items():
        setattr(config.model, key, value)
    assert validate(config, 1) == []
    assert window_layers(config.model) == [4, 4, None, 4, 4, None, 4, 4]
    model = GPTModel(config.model, 100, 128)
    assert [layer.attention.core_attention.window for layer in model.layers.values()] == window_layers(config.model)
    assert {n for n, _ in model.named_parameters() if n.startswith("layers.0.") and "norm" in n} == {
        f"layers.0.{n}.weight" for n in ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm",
                                         "post_mlp_layernorm", "attention.q_layernorm", "attention.k_layernorm")}
    from ptdp.parallel.init import init_parameters

    init_parameters(model, seed=1, std=0.02, num_layers=8)  # the (1 + w) norms start at w = 0: the identity scale
    assert all(torch.equal(p, torch.zeros_like(p)) for n, p in model.named_parameters() if "layernorm" in n)


def test_gemma3_1b_preset_has_the_published_parameter_count_and_plans(capsys):
    """google/gemma-3-1b-pt holds 999,885,952 parameters (tied embeddings); ``ptdp plan`` runs on the presets."""
    from ptdp.cli.main import main
    from ptdp.config import ModelConfig
    from ptdp.config.presets import MODEL_PRESETS
    from ptdp.models import GPTModel

    preset = MODEL_PRESETS["gemma3-1b"]
    with torch.device("meta"):
        model = GPTModel(ModelConfig(**preset), preset["vocab_size"], preset["vocab_size"])
    assert sum(p.numel() for p in model.parameters()) == 999_885_952
    for name in ("gemma3-1b", "gemma3-27b"):
        assert main(["plan", "--model", name, "--gpus", "8", "--global-batch-size", "64"]) == 0
        assert "parameters" in capsys.readouterr().out
