"""The GeLU MLP's two forms, chosen by Megatron-LM's flags: the tanh approximation where Megatron computes it
(``--openai-gelu``, or its fused bias-GeLU: linear biases without ``--no-bias-gelu-fusion``), the exact erf
GeLU otherwise. The flags map as Megatron's do; the dense MLP, its fused/compiled path and the MoE experts
compute the chosen form (and not the other; compiled: tests/models/test_fused.py); Megatron checkpoint args import and export it; a checkpoint of
the other form is refused by name, as are --openai-gelu with a gated MLP and HF activations ptdp lacks.
The HF GPT-2 comparison (one process, t = 2, p = 2) is tests/models/test_hf.py's ``exact_gelu``."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY, config_errors, refused_in_process

from ptdp.config import ModelConfig, MoEConfig, add_config_arguments, config_from_args

# (flags, the form Megatron-Core computes): the fused bias-GeLU is the tanh one, the unfused GeLU exact
MEGATRON_RULE = [
    ([], "tanh"),
    (["--no-bias-gelu-fusion"], "none"),
    (["--disable-bias-linear"], "none"),  # Megatron turns the fusion off without biases
    (["--openai-gelu"], "tanh"),
    (["--openai-gelu", "--no-bias-gelu-fusion"], "tanh"),
    (["--openai-gelu", "--disable-bias-linear"], "tanh"),
]


def _model(*flags: str) -> ModelConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(list(flags))).model


@pytest.mark.parametrize("flags, form", MEGATRON_RULE)
def test_flags_choose_the_form_megatron_computes(flags, form):
    assert _model(*flags).gelu_approximate == form


def test_a_config_file_takes_the_same_keys(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("bias-gelu-fusion = false\n")
    assert _model("--config", str(path)).gelu_approximate == "none"


def _mlp_input(cfg: ModelConfig):
    from ptdp.models.gpt import MLP
    from ptdp.ops import fused

    torch.manual_seed(0)
    mlp = MLP(cfg, fused.EAGER)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0.0, 0.5)
    return mlp, torch.randn(2, 8, cfg.hidden_size)


@pytest.mark.parametrize("flags", [["--no-bias-gelu-fusion"], ["--disable-bias-linear"], []])
def test_the_mlp_computes_the_chosen_form_and_not_the_other(flags):
    cfg = _model("--hidden-size", "16", *flags)
    mlp, x = _mlp_input(cfg)
    fc1 = F.linear(x, mlp.fc1.weight.reshape(-1, 16), None if mlp.fc1.bias is None else mlp.fc1.bias.reshape(-1))
    want = {form: F.linear(F.gelu(fc1, approximate=form), mlp.fc2.weight, mlp.fc2.bias) for form in ("tanh", "none")}
    got = mlp(x)
    torch.testing.assert_close(got, want[cfg.gelu_approximate], rtol=1e-6, atol=1e-6)
    other = "tanh" if cfg.gelu_approximate == "none" else "none"
    assert (got - want[other]).abs().max() > 1e-4  # the two forms are told apart at these scales


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_the_fused_bias_gelu_computes_either_form(approximate):
    from ptdp.ops import fused

    y, bias = torch.randn(4, 32) * 3, torch.randn(32)
    torch.testing.assert_close(fused.bias_gelu(y, bias, approximate), F.gelu(y + bias, approximate=approximate))


def test_the_experts_compute_the_dense_mlps_form():
    from ptdp.models.moe import GroupedExperts

    torch.manual_seed(0)
    x, counts = torch.randn(6, 16), torch.tensor([4, 2])
    outs = {}
    for flags in ([], ["--no-bias-gelu-fusion"]):
        experts = GroupedExperts(_model("--hidden-size", "16", *flags), MoEConfig(num_experts=2, moe_ffn_hidden_size=8))
        torch.manual_seed(1)
        with torch.no_grad():
            for p in experts.parameters():
                p.normal_(0.0, 1.0)
        outs[experts.approximate] = experts(x, counts)
        w1, w2 = experts.fc1_weight[:, 0], experts.fc2_weight
        rows = [F.gelu(x[i] @ w1[e].T, approximate=experts.approximate) @ w2[e].T
                for i, e in enumerate([0, 0, 0, 0, 1, 1])]
        torch.testing.assert_close(outs[experts.approximate], torch.stack(rows), rtol=1e-5, atol=1e-5)
    assert (outs["tanh"] - outs["none"]).abs().max() > 1e-4


MEGATRON_GPT = dict(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=128, swiglu=False)


@pytest.mark.parametrize("args, form", [
    ({"add_bias_linear": True, "bias_gelu_fusion": True}, "tanh"),
    ({"add_bias_linear": True, "bias_gelu_fusion": False}, "none"),
    ({"add_bias_linear": False, "bias_gelu_fusion": False}, "none"),
    ({"add_bias_linear": False, "bias_gelu_fusion": False, "openai_gelu": True}, "none"),  # Megatron-Core ignores it
    ({"add_bias_linear": False, "openai_gelu": True, "use_legacy_models": True}, "tanh"),  # the legacy MLP reads it
])
def test_megatron_checkpoint_args_import_as_the_form_they_computed(args, form):
    from ptdp.megatron.args import model_from_args

    cfg, _ = model_from_args({**MEGATRON_GPT, **args})
    assert cfg.gelu_approximate == form


@pytest.mark.parametrize("flags, written", [
    ([], {"bias_gelu_fusion": True, "add_bias_linear": True}),
    (["--no-bias-gelu-fusion"], {"bias_gelu_fusion": False, "add_bias_linear": True}),
    (["--disable-bias-linear"], {"bias_gelu_fusion": False, "add_bias_linear": False}),
])
def test_megatron_export_writes_the_args_megatron_computes_the_form_with(flags, written):
    from ptdp.megatron.args import args_from_model, export_problem, model_from_args

    cfg = _model(*flags)
    args = args_from_model(cfg, MoEConfig(), 128)
    assert {k: args[k] for k in written} == written and export_problem(cfg, MoEConfig()) is None
    assert model_from_args(args)[0].gelu_approximate == cfg.gelu_approximate  # and it reads back


def test_megatron_export_refuses_the_tanh_gelu_without_biases():
    from ptdp.megatron.args import export_problem

    problem = export_problem(_model("--openai-gelu", "--disable-bias-linear"), MoEConfig())
    assert problem is not None and "--openai-gelu with --disable-bias-linear" in problem


def test_a_checkpoint_of_the_other_form_is_refused_by_name():
    from ptdp.checkpointing.validation import model_mismatch, model_shape

    tanh, exact = _model(), _model("--no-bias-gelu-fusion")
    problem = model_mismatch(model_shape(tanh, 257, 384), exact, None, 1)
    assert problem is not None and "the GeLU tanh there, exact here" in problem
    assert model_mismatch(model_shape(exact, 257, 384), exact, None, 1) is None
    before = {k: v for k, v in model_shape(_model("--disable-bias-linear"), 257, 384).items()
              if k not in ("openai_gelu", "bias_gelu_fusion")}  # a checkpoint from before the option: tanh
    assert "the GeLU tanh there, exact here" in model_mismatch(before, _model("--disable-bias-linear"), None, 1)
    assert model_mismatch(before, _model("--disable-bias-linear", "--openai-gelu"), None, 1) is None


def test_openai_gelu_with_a_gated_mlp_is_refused_in_one_line(capsys):
    assert any(e.startswith("--openai-gelu picks") for e in config_errors(1, openai_gelu=True, swiglu=True))
    proc = refused_in_process(["train", *TINY, "--openai-gelu", "--swiglu"], capsys)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "--openai-gelu picks" in lines[0], proc.stderr


def test_hf_gpt2_activations_map_to_the_forms_and_others_are_refused():
    from ptdp.hf.convert import train_flags
    from ptdp.models.gpt2 import hf

    config = dict(n_embd=32, n_layer=2, n_head=4, n_positions=16, vocab_size=300)
    for activation, form in (("gelu_new", "tanh"), ("gelu_pytorch_tanh", "tanh"), ("gelu", "none")):
        cfg = hf.model_config_from_hf({**config, "activation_function": activation})
        assert cfg.gelu_approximate == form
        assert ("--no-bias-gelu-fusion" in train_flags(cfg)) == (form == "none")
        assert hf.hf_config_dict(cfg, 0)["activation_function"] == ("gelu" if form == "none" else "gelu_new")
    with pytest.raises(hf.GPT2ConversionError, match="activation_function='gelu_fast'"):
        hf.model_config_from_hf({**config, "activation_function": "gelu_fast"})
