"""Loading, validating and deriving the configuration (one validation for every source): TOML values checked
against the field types, unknown keys and tables one line each, every problem reported at once, a pure
``validate``, a ``derive`` that returns a new object, and one schedule registry behind every check."""

from __future__ import annotations

import argparse
import copy

import pytest
from helpers import TINY, run_ptdp

from ptdp.config import Config, ConfigError, add_config_arguments, config_from_args, derive, validate


def _load(tmp_path, text: str, *flags: str) -> Config:
    path = tmp_path / "run.toml"
    path.write_text(text)
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(["--config", str(path), *flags]))


def test_toml_value_of_the_wrong_type_is_one_line_with_key_type_and_value(tmp_path):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, 'num-layers = "4"\n')
    assert len(err.value.problems) == 1
    line = err.value.problems[0]
    assert "num-layers" in line and "an integer" in line and '"4"' in line and "string" in line, line


@pytest.mark.parametrize("text,words", [
    ("use-distributed-optimizer = 1\n", ["use-distributed-optimizer", "true or false", "1"]),
    ("lr = \"fast\"\n", ["lr", "a number", '"fast"']),
    ('lr-decay-style = "cos"\n', ["lr-decay-style", "one of cosine, linear, constant", '"cos"']),
    ("data-path = [1, 2]\n", ["data-path", "a list of strings"]),
])
def test_each_field_type_is_checked(tmp_path, text, words):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, text)
    assert len(err.value.problems) == 1 and all(w in err.value.problems[0] for w in words), err.value.problems


def test_ints_are_numbers_and_a_single_data_path_is_a_list(tmp_path):
    config = _load(tmp_path, 'lr = 1\ndata-path = "corpus_text_document"\nlayernorm-epsilon = 1e-6\n')
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)
    assert config.data.data_path == ["corpus_text_document"]
    assert config.model.norm_epsilon == 1e-6  # Megatron's older spelling still read


def test_unknown_keys_and_tables_are_one_line_each_all_at_once(tmp_path):
    text = 'num-layer = 6\nhidden-size = "big"\n[model]\nnum-layers = 4\n[parallel]\nsequence-parallel = true\n'
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, text)
    problems = err.value.problems
    assert len(problems) == 4, problems
    assert any("unknown key num-layer" in p and "did you mean num-layers" in p for p in problems)
    assert any("hidden-size" in p and "an integer" in p for p in problems)
    assert any("[model] is a table" in p for p in problems)
    assert any("[parallel] is a table" in p for p in problems)
    assert all("run.toml" in p for p in problems)


def test_validate_reports_every_problem_at_once():
    config = Config()
    config.parallel.pipeline_model_parallel_size = 3  # world 4 is not divisible by it
    config.model.hidden_dropout = 1.5
    config.optimizer.min_lr, config.optimizer.lr = 1.0, 0.1
    config.optimizer.clip_grad = -1
    config.precision.bf16 = config.precision.fp16 = True
    config.model.num_layers = 0
    errors = validate(config, 4)
    for flag in ("world size 4", "--hidden-dropout", "--min-lr", "--clip-grad", "--bf16", "--num-layers"):
        assert sum(flag in e for e in errors) == 1, (flag, errors)
    assert len(errors) == 6, errors


def test_validate_type_checks_a_config_built_in_python():
    config = Config()
    config.model.num_layers = "4"
    assert validate(config, 1) == ['--num-layers: expected an integer, got "4" (a string)']


def test_validate_does_not_mutate_and_derive_returns_a_new_object():
    config = Config()
    config.model.num_layers = 8
    config.parallel.pipeline_model_parallel_size = 2
    config.parallel.num_layers_per_virtual_pipeline_stage = 2
    config.training.global_batch_size = 16
    before = copy.deepcopy(config)
    assert validate(config, 2) == []
    assert config == before and config.parallel.virtual_pipeline_model_parallel_size is None
    derived = derive(config)
    assert derived is not config and derived.parallel is not config.parallel
    assert derived.parallel.virtual_pipeline_model_parallel_size == 2 and derived.parallel.schedule == "interleaved"
    assert config == before  # derive left it alone too


def test_schedule_constraints_come_from_the_registry():
    """One ``schedule_problems`` line (from the registry's ``ScheduleSpec``) behind train's validation, the
    planner and the simulator; the schedule itself refuses the same numbers in its own terms."""
    from ptdp.config.validate_pipeline import schedule_problems
    from ptdp.planner.search import invalid_reason
    from ptdp.planner.spec import ClusterSpec, GPTSpec, ParallelConfig, TrainingSpec
    from ptdp.schedule.registry import REGISTRY

    line = schedule_problems("zbv", 2, 3, 8)[0]
    assert line.startswith("--pipeline-schedule zbv places 2 model chunks per rank")
    config = Config()
    config.model.num_layers = 12
    config.parallel.pipeline_model_parallel_size = 2
    config.parallel.virtual_pipeline_model_parallel_size = 3
    config.parallel.pipeline_schedule = "zbv"
    assert line in validate(config, 2)
    model = GPTSpec(12, 64, 4, 32, 256)
    assert invalid_reason(model, ParallelConfig(1, 2, 1, 3, 1, pipeline_schedule="zbv"), ClusterSpec.of("a100-80gb", 2),
                          TrainingSpec(8)) == line
    with pytest.raises(ValueError, match=r"zbv runs 2 model chunk\(s\) per rank \(v=2\), got v=3"):
        REGISTRY["zbv"].compute(2, 3, 8, 0)


def test_plan_and_simulate_share_train_flags():
    from ptdp.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for flag, commands in (("--num-layers", ("plan",)), ("--swiglu", ("plan",)), ("--pipeline-schedule", ("plan", "simulate")),
                           ("--tensor-model-parallel-size", ("plan",)), ("--cp-comm-type", ("plan",))):
        train = sub["train"]._option_string_actions[flag]
        for name in commands:
            other = sub[name]._option_string_actions[flag]
            assert (other.type, other.choices, other.dest) == (train.type, train.choices, train.dest), (flag, name)
            assert other.help.split(" (default")[0] == train.help.split(" (default")[0]


def test_plan_declares_only_the_cluster_and_output_flags():
    """Every other flag of ``ptdp plan`` is ``ptdp train``'s (same name, same destination): the model, the
    layout, --bf16/--fp16, --recompute-granularity (plus plan's ``none``), --use-distributed-optimizer;
    --mean-document-length describes a workload to plan for (train reads the documents themselves)."""
    from ptdp.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    plan_only = {"--gpus", "--gpu", "--gpus-per-node", "--intra-node-bandwidth", "--inter-node-bandwidth",
                 "--json", "--top", "--help", "--no-use-distributed-optimizer",
                 "--mean-document-length"}
    train = sub["train"]._option_string_actions
    for flag, action in sub["plan"]._option_string_actions.items():
        if flag.startswith("--") and flag not in plan_only:
            assert flag in train and train[flag].dest == action.dest, flag


def test_cli_prints_every_problem_one_line_each_without_traceback(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('num-layers = "4"\nnum-layer = 6\n[model]\nhidden-size = 32\n')
    proc = run_ptdp(["train", *TINY, "--config", str(path)], check=False, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("ptdp train: error: --config") for line in lines), lines
    proc = run_ptdp(["train", *TINY, "--hidden-dropout", "2", "--clip-grad", "-1", "--tensor-model-parallel-size", "2"],
                    check=False, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 3, lines
