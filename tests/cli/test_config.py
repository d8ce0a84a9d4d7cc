"""Configuration: flags, TOML, and one clear line per bad input, with no traceback and no hang."""

from __future__ import annotations

import pytest
from helpers import TINY, config_errors, run_ptdp

from ptdp.config import ModelConfig


def test_default_config_is_valid():
    assert config_errors(1) == []


@pytest.mark.parametrize("world,overrides,flag", [
    (3, {"tensor_model_parallel_size": 2}, "--tensor-model-parallel-size"),
    (2, {"tensor_model_parallel_size": 2, "num_attention_heads": 3, "hidden_size": 96}, "--num-attention-heads"),
    (2, {"pipeline_model_parallel_size": 2, "num_layers": 3}, "--num-layers"),
    (2, {"global_batch_size": 12, "micro_batch_size": 4}, "--global-batch-size"),
    (2, {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2,
         "global_batch_size": 12, "micro_batch_size": 4}, "interleaved"),
    (1, {"hidden_dropout": 1.5}, "--hidden-dropout"),
])
def test_each_problem_names_its_flag(world, overrides, flag):
    errors = config_errors(world, **overrides)
    assert len(errors) == 1 and flag in errors[0], errors


def test_padded_vocab_is_layout_independent():
    cfg = ModelConfig()
    assert {cfg.padded_vocab_size(257, t) for t in (1, 2, 4, 8)} == {384}
    assert cfg.padded_vocab_size(257, 5) == 640  # t=5 must divide it too


def test_bad_input_exits_with_one_line_and_no_traceback(tmp_path):
    proc = run_ptdp(["train", *TINY, "--nproc-per-node", "3", "--tensor-model-parallel-size", "2"],
                    check=False, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "ptdp train: error: world size 3 is not divisible by --tensor-model-parallel-size x "
        "--pipeline-model-parallel-size = 2x1; use a world size that is a multiple of 2"]


def test_toml_config_with_command_line_override(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('num-layers = 6\nhidden_size = 48\nlr-decay-style = "linear"\n')
    from ptdp.cli.main import build_parser
    from ptdp.config import config_from_args

    args = build_parser().parse_args(["train", "--config", str(path), "--num-layers", "2"])
    config = config_from_args(args)
    assert (config.model.num_layers, config.model.hidden_size, config.optimizer.lr_decay_style) == (2, 48, "linear")


def test_unknown_toml_key_is_rejected(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("num-layer = 6\n")
    proc = run_ptdp(["train", "--config", str(path)], check=False, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "unknown key num-layer" in proc.stderr
