"""GPT-OSS (``GptOssForCausalLM``), imported from a random Hugging Face model built here (no hub): 4 layers
alternating windows of 8 tokens and global attention at a sequence of 32 (the windows bite), a learned sink
per head, biases on q/k/v/o, the router and the experts, the clamped quick-GeGLU (a clamp of 1 so that it
bites) and YaRN with its ramp unrounded. Import gives HF's logits, export loads back in ``transformers`` bit
for bit, the MXFP4 blocks and scales of the published checkpoints dequantize as transformers' own function
does, and ``ptdp train`` in one process, at t = 2 with sequence parallelism and p = 2, with (t, e) = (2, 2)
folded, with ZeRO-3 over d = 2, at c = 2 with each ``--cp-comm-type``, interleaved p = 2 with full
recomputation and ZBV with vocabulary parallelism equals ``transformers`` + ``torch.optim.AdamW`` per iteration
(loss and gradient norm); the one-process run's final weights equal HF's. Also the sink attention core against a
naive softmax, its rescaling form, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (
    assert_export_equals_hf_files,
    assert_reload_equals_hf,
    config_errors,
    hf_family_tests,
)

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from ptdp.checkpointing import read_full_model_state  # noqa: E402
from ptdp.config import Config, validate  # noqa: E402
from ptdp.hf.convert import full_model_from_state, import_hf_model  # noqa: E402
from ptdp.models.sinks import sink_attention, sink_rescale  # noqa: E402

V, S, W = 300, 32, 8
KINDS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 16, "rope_theta": 10000.0}
LAYOUTS = {"t2-sp-p2": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",  # experts whole per rank
                            "--pipeline-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]),
           "t2-e2-folded": (2, ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                                "--expert-tensor-parallel-size", "1", "--sequence-parallel"]),
           "d2-zero3": (2, ["--data-parallel-sharding-strategy", "optim_grads_params"]),
           # windows across the CP chunks (8 tokens each), sinks in every layer: the windowed exchange and the
           # ring with its sink merged, and Ulysses
           "c2-p2p": (2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
           "c2-a2a": (2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
           "c2-allgather": (2, ["--context-parallel-size", "2", "--cp-comm-type", "allgather"]),
           "p2-interleaved-recompute": (2, ["--pipeline-model-parallel-size", "2",
                                            "--virtual-pipeline-model-parallel-size", "2", "--pipeline-schedule",
                                            "interleaved", "--recompute-granularity", "full",
                                            "--recompute-method", "uniform"]),
           "p2-zbv-vocab": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
                                "--enable-vocab-parallel"])}


def hf_config(**overrides):
    return transformers.GptOssConfig(**{
        "vocab_size": V, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": len(KINDS),
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
        "num_experts_per_tok": 2, "sliding_window": W, "max_position_embeddings": 4096, "initializer_range": 0.1,
        "rms_norm_eps": 1e-6, "rope_parameters": YARN, "layer_types": KINDS, "swiglu_limit": 1.0,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **overrides})


def hf_model(directory, **overrides):
    """A random GPT-OSS whose biases and sinks are away from their zero init (so that every one matters)."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(hf_config(**overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "bias" in name or "sinks" in name:
                param.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    model.float().eval()
    model.save_pretrained(str(directory), safe_serialization=True)
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(1))


def test_import_gives_hf_logits_and_export_loads_back_bit_for_bit(tmp_path):
    hf = hf_model(tmp_path / "hf")
    _assert_import_equals_the_layout_formulas(hf)
    _, cfg, moe = import_hf_model(tmp_path / "hf", tmp_path / "ckpt")
    assert (cfg.window_size, cfg.window_attn_skip_freq, cfg.softmax_type, cfg.quick_geglu) == (W, "2", "learnable", True)
    assert (cfg.glu_linear_offset, cfg.activation_func_clamp_value, cfg.add_bias_linear) == (1.0, 1.0, True)
    assert (cfg.rope_type, cfg.rotary_scaling_factor, cfg.yarn_correction_range_round_to_int) == ("yarn", 4.0, False)
    assert (moe.num_experts, moe.moe_router_topk, moe.moe_linear_bias) == (4, 2, True)
    ours = full_model_from_state(*read_full_model_state(tmp_path / "ckpt"))
    tokens = _tokens()
    with torch.no_grad():
        expected = hf(tokens).logits
        torch.testing.assert_close(ours(tokens)[..., :V], expected, rtol=0, atol=1e-5)
        # the sinks, the windows and the clamp bite: without each, HF computes other logits
        for change in ({"layer_types": ["full_attention"] * len(KINDS)}, {"swiglu_limit": 100.0}):
            other = transformers.GptOssForCausalLM(hf_config(**change)).eval()
            other.load_state_dict(hf.state_dict())
            assert not torch.allclose(other(tokens).logits, expected, atol=1e-3), change
        state = {k: (torch.full_like(v, -30.0) if k.endswith("sinks") else v) for k, v in hf.state_dict().items()}
        other.load_state_dict(state)
        assert not torch.allclose(other(tokens).logits, expected, atol=1e-3)

    saved = assert_export_equals_hf_files(tmp_path / "ckpt", tmp_path / "out", tmp_path / "hf")
    assert saved["model_type"] == "gpt_oss" and saved["layer_types"] == KINDS and saved["sliding_window"] == W
    assert saved["rope_parameters"]["truncate"] is False and saved["swiglu_limit"] == 1.0
    assert_reload_equals_hf(tmp_path / "out", tokens, expected)


def _mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 131, shape, generator=g, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_dequantizes_as_transformers_does():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    from ptdp.models.mxfp4 import dequantize_mxfp4

    blocks, scales = _mxfp4((3, 10, 2), 0)
    want = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    got = dequantize_mxfp4(blocks, scales)
    assert got.shape == (3, 64, 10)
    assert torch.equal(got, want)
    # one value by hand: code 0x7 (+6.0) in the low nibble, 0xA (-1.0) in the high one, scale 2^(128-127)
    one = dequantize_mxfp4(torch.tensor([[[[0xA7] + [0] * 15]]], dtype=torch.uint8), torch.tensor([[[128]]],
                                                                                                   dtype=torch.uint8))
    assert one[0, :2, 0].tolist() == [12.0, -2.0]


def test_an_mxfp4_checkpoint_imports_its_dequantized_experts(tmp_path):
    """The published checkpoints' layout: ``gate_up_proj_blocks``/``_scales`` in place of ``gate_up_proj``
    (likewise ``down_proj``); import reads what transformers' dequantization makes of them."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    hf_model(tmp_path / "hf")
    tensors = safetensors_torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    for i in range(len(KINDS)):
        for name, rows, cols in (("gate_up_proj", 64, 64), ("down_proj", 64, 32)):
            key = f"model.layers.{i}.mlp.experts.{name}"
            blocks, scales = _mxfp4((4, rows, cols // 32), 10 * i + len(name))
            del tensors[key]
            tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
            tensors[key] = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    quantized = {k: v for k, v in tensors.items() if not k.endswith(("gate_up_proj", "down_proj"))}
    dense = {k: v for k, v in tensors.items() if not k.endswith(("_blocks", "_scales"))}
    from ptdp.models.gpt_oss.hf import read_gpt_oss

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    _, _, from_blocks = read_gpt_oss(config, quantized)
    _, _, from_dense = read_gpt_oss(config, dense)
    assert from_blocks.keys() == from_dense.keys()
    for name, value in from_dense.items():
        assert torch.equal(from_blocks[name], value), name


def _assert_import_equals_the_layout_formulas(hf) -> None:
    """The recipe import, bit for bit as the formulas of HF's layout: the QKV bias fused per key/value
    group, ``gate_up_proj``'s even columns the gate and odd the up, each expert's matrices transposed."""
    from ptdp.models.gpt_oss.hf import read_gpt_oss

    state = {k: v.detach() for k, v in hf.state_dict().items()}
    _, _, got = read_gpt_oss(hf.config.to_dict(), state)
    for i in range(len(KINDS)):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}.self_attn."
        q, k, v = (state[f"{theirs}{x}_proj.bias"].view(2, -1) for x in "qkv")  # 2 groups of 2 query heads
        gate_up, bias = state[f"model.layers.{i}.mlp.experts.gate_up_proj"], state[f"model.layers.{i}.mlp.experts.gate_up_proj_bias"]
        want = {"attention.qkv.bias": torch.cat([q, k, v], 1).flatten(),
                "mlp.experts.fc1_weight": torch.stack([gate_up[..., 0::2], gate_up[..., 1::2]], 1).transpose(2, 3),
                "mlp.experts.fc1_bias": torch.stack([bias[..., 0::2], bias[..., 1::2]], 1),
                "mlp.experts.fc2_weight": state[f"model.layers.{i}.mlp.experts.down_proj"].transpose(1, 2),
                "attention.sinks.weight": state[theirs + "sinks"]}
        for name, value in want.items():
            assert torch.equal(got[ours + name], value), (i, name)


@pytest.mark.parametrize("field,value", [("swiglu_alpha", 1.5),
                                         ("rope_parameters", {"rope_type": "linear", "factor": 2.0}),
                                         ("layer_types", ["chunked_attention"] * 4)])
def test_import_refuses_what_it_does_not_compute_in_one_line_naming_the_field(field, value):
    from ptdp.config import ConfigError
    from ptdp.models.gpt_oss import hf

    config = {**hf_config().to_dict(), field: value}
    with pytest.raises(ConfigError, match=field.split("_")[0]) as info:
        hf.read_gpt_oss(config, {})
    assert "\n" not in str(info.value)


(trained, test_one_process_equals_hf_and_adamw_per_iteration_and_in_its_weights,
 test_layout_equals_hf_and_adamw_per_iteration) = hf_family_tests("gpt_oss", hf_model, LAYOUTS, V, S)


@pytest.mark.parametrize("window", [None, 1, 5, 40])
def test_sink_attention_equals_a_naive_softmax_with_one_more_logit(window):
    """Query i sees its allowed keys and a sink z_head whose probability attends to nothing; the same output
    is the sink-free attention rescaled by sigmoid(lse - z)."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 3, 24, 16, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(3, generator=g, dtype=torch.float64)
    i, j = torch.arange(24)[:, None], torch.arange(24)[None, :]
    allowed = (j <= i) & (i - j < (window or 24))
    got = sink_attention(q, k, v, sinks, allowed if window else None, scale=0.3)
    scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~allowed, float("-inf"))
    exp = (scores - 0).exp()
    want = (exp / (exp.sum(-1, keepdim=True) + sinks.exp().view(1, 3, 1, 1))) @ v
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    lse = scores.logsumexp(-1)
    torch.testing.assert_close(sink_rescale(scores.softmax(-1) @ v, lse, sinks), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("world,overrides,line", [
    (1, {"softmax_type": "learnable", "multi_latent_attention": True},
     "--softmax-type learnable with --multi-latent-attention"),
    (1, {"glu_linear_offset": 1.0}, "--glu-linear-offset and --activation-func-clamp-value act on a gated MLP"),
    (1, {"quick_geglu": True, "swiglu": True}, "--swiglu, --geglu and --quick-geglu are three MLPs"),
    (1, {"moe_linear_bias": True}, "--moe-linear-bias needs a mixture of experts"),
    (2, {"moe_linear_bias": True, "num_experts": 4, "tensor_model_parallel_size": 2},
     "--moe-linear-bias with --expert-tensor-parallel-size > 1"),
    (1, {"rope_type": "yarn"}, "--rope-type yarn scales the rotary embedding"),
])
def test_gpt_oss_flags_refuse_what_they_do_not_compute_in_one_line(world, overrides, line):
    errors = config_errors(world, **overrides)
    assert any(e.startswith(line) for e in errors), errors
    assert all("\n" not in e for e in errors)


def test_presets_hold_hf_parameter_counts_validate_and_plan(capsys):
    """gpt-oss-20b and -120b hold what HF's ``GptOssForCausalLM`` of the published config.json holds;
    tiny-gpt-oss validates and alternates windows; ``ptdp plan`` runs on the presets."""
    from ptdp.cli.main import main
    from ptdp.config import ModelConfig, MoEConfig
    from ptdp.config.presets import MODEL_PRESETS, MOE_PRESETS
    from ptdp.config.validate_window import window_layers
    from ptdp.models import GPTModel

    for name, layers, experts in (("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)):
        preset = MODEL_PRESETS[name]
        with torch.device("meta"):
            ours = GPTModel(ModelConfig(**preset), preset["vocab_size"], preset["vocab_size"],
                            MoEConfig(**MOE_PRESETS[name]))
            theirs = transformers.GptOssForCausalLM(transformers.GptOssConfig(
                num_hidden_layers=layers, num_local_experts=experts))
        assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters()), name
    config = Config()
    for key, value in MODEL_PRESETS["tiny-gpt-oss"].items():
        setattr(config.model, key, value)
    for key, value in MOE_PRESETS["tiny-gpt-oss"].items():
        setattr(config.moe, key, value)
    assert validate(config, 1) == []
    assert window_layers(config.model) == [4, None, 4, None]
    for name in ("gpt-oss-20b", "gpt-oss-120b"):
        assert main(["plan", "--model", name, "--gpus", "64", "--global-batch-size", "64"]) == 0
        assert "parameters" in capsys.readouterr().out


def test_flops_and_the_planner_price_a_windowed_layer_by_its_window():
    """tiny-gpt-oss at s = 16: two layers see 4 keys per query, two see 16, so attention counts 10 keys per
    query on average; the FLOPs' attention term shrinks accordingly, in the trainer's count and the planner's."""
    from ptdp.config import ModelConfig, MoEConfig
    from ptdp.config.presets import MODEL_PRESETS, MOE_PRESETS
    from ptdp.models import flops
    from ptdp.planner.spec import GPTSpec

    cfg, moe = ModelConfig(**MODEL_PRESETS["tiny-gpt-oss"]), MoEConfig(**MOE_PRESETS["tiny-gpt-oss"])
    assert flops.windowed_attention_length(cfg) == (4 + 16) / 2
    assert GPTSpec.from_model_config(cfg).attended == 10.0
    kwargs = dict(ffn_hidden_size=cfg.ffn_size, moe=flops.moe_shape(cfg, moe), **flops.architecture(cfg))
    args = (cfg.num_layers, cfg.hidden_size, cfg.seq_length, 128, 8)
    full = flops.flops_per_iteration(*args, recompute=False, **kwargs)
    windowed = flops.flops_per_iteration(*args, recompute=False, attention_length=10.0, **kwargs)
    q = cfg.num_attention_heads * cfg.head_dim
    assert full - windowed == 3 * cfg.num_layers * 8 * 16 * 4 * (16 - 10) * q  # fwd + bwd, B·s tokens
    assert flops.windowed_attention_length(ModelConfig()) is None
