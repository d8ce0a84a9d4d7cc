"""One validated configuration tree for a training run (``ptdp train``, and the model and layout flags of
``ptdp plan`` and ``ptdp simulate``).

* ``schema``: the dataclasses, one field per flag (Megatron-LM's names), declared once;
* ``load``: flags and ``--config FILE.toml`` to a :class:`Config`, every value checked against its type;
* ``validate``: a pure function from a configuration and a world size to every problem, one line each;
* ``derive``: the resolved values, as a new object.
"""

from __future__ import annotations

from ptdp.config.derive import Layout, derive, layout
from ptdp.config.load import (
    add_config_arguments,
    add_field_arguments,
    config_from_args,
    flag_of,
    model_config,
    read_toml,
    toml_values,
    type_problems,
)
from ptdp.config.schema import (
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    LoRAConfig,
    MixedPrecisionConfig,
    ModelConfig,
    MoEConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainingConfig,
    opt,
)
from ptdp.config.validate import validate

__all__ = [
    "CheckpointConfig", "Config", "ConfigError", "DataConfig", "Layout", "LoRAConfig", "MixedPrecisionConfig", "ModelConfig",
    "MoEConfig", "OptimizerConfig", "ParallelConfig", "TrainingConfig", "add_config_arguments", "add_field_arguments",
    "config_from_args", "derive", "flag_of", "layout", "model_config", "opt", "read_toml", "toml_values",
    "type_problems", "validate",
]
