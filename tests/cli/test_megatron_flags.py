"""Megatron-LM flags a user pastes from Megatron-LM's scripts: those that mean something in ptdp are accepted
(no-ops, or mapped to ptdp's own flags), the well-known ones ptdp does not implement are refused with one line
saying what they are for, not argparse's bare "unrecognized arguments" or a misleading "did you mean"."""

from __future__ import annotations

import argparse

import pytest
from helpers import run_ptdp

from ptdp.cli.main import build_parser
from ptdp.cli.parser import subparser, unknown_arguments_message
from ptdp.config import Config, ConfigError, add_config_arguments, config_from_args
from ptdp.config.megatron_flags import EXPLAINED_FLAGS, NO_OP_FLAGS


def _config(*flags: str, toml: str | None = None, tmp_path=None) -> Config:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    if toml is not None:
        path = tmp_path / "run.toml"
        path.write_text(toml)
        flags = ("--config", str(path), *flags)
    return config_from_args(parser.parse_args(list(flags)))


def test_flash_attention_and_core_model_flags_are_accepted_and_change_nothing():
    assert _config("--use-flash-attn", "--use-mcore-models") == Config()
    assert _config(*NO_OP_FLAGS) == Config()  # every no-op flag, all at once


def test_no_op_flags_are_documented_in_help():
    train = subparser(build_parser(), "train")
    helps = {s: a.help for a in train._actions for s in a.option_strings}
    assert "scaled_dot_product_attention" in helps["--use-flash-attn"]
    assert "ignored" in helps["--use-mcore-models"]


def test_recompute_activations_means_selective_recomputation():
    assert _config("--recompute-activations").model.recompute_granularity == "selective"
    with pytest.raises(ConfigError, match="contradicts --recompute-granularity full"):
        _config("--recompute-activations", "--recompute-granularity", "full")


def test_lr_warmup_fraction_is_a_fraction_of_the_decay_iterations():
    assert _config("--lr-warmup-fraction", "0.1", "--train-iters", "50").optimizer.lr_warmup_iters == 5
    assert _config("--lr-warmup-fraction", "0.25", "--lr-decay-iters", "10").optimizer.lr_warmup_iters == 2
    with pytest.raises(ConfigError, match="give one of them"):
        _config("--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3")
    with pytest.raises(ConfigError, match=r"expected a fraction in \[0, 1\]"):
        _config("--lr-warmup-fraction", "2")


def test_a_config_file_takes_the_same_megatron_keys(tmp_path):
    config = _config(toml="use-flash-attn = true\nrecompute-activations = true\nlr-warmup-fraction = 0.5\n"
                     "train-iters = 8\n", tmp_path=tmp_path)
    assert config.model.recompute_granularity == "selective" and config.optimizer.lr_warmup_iters == 4
    with pytest.raises(ConfigError) as err:
        _config(toml='transformer-impl = "local"\nuse-mcore-models = 1\n', tmp_path=tmp_path)
    problems = err.value.problems
    assert len(problems) == 2, problems
    assert "--transformer-impl is Megatron-LM's choice" in problems[0]
    assert "use-mcore-models" in problems[1] and "true or false" in problems[1]


@pytest.mark.parametrize("flag", sorted(EXPLAINED_FLAGS))
def test_each_unimplemented_megatron_flag_is_explained(flag):
    line = unknown_arguments_message([flag, "1"], subparser(build_parser(), "train"))
    assert line.startswith(f"{flag} is Megatron-LM's") and "ptdp" in line and "did you mean" not in line


def test_an_unimplemented_flag_is_one_line_naming_it_without_a_traceback():
    proc = run_ptdp(["train", "--transformer-impl", "transformer_engine", "--train-iters", "1"], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ptdp train: error: --transformer-impl is Megatron-LM's"), lines


def test_other_unknown_flags_keep_their_suggestion():
    line = unknown_arguments_message(["--train-iter", "3"], subparser(build_parser(), "train"))
    assert line == "unrecognized argument(s): --train-iter 3; did you mean --train-iters?"
