"""Derived values, computed in a step of their own after :func:`ptdp.config.validate` found no problem.

:func:`derive` returns a NEW :class:`Config` (the one given is left as it was) whose values are resolved:
v from Megatron's alternative ``--num-layers-per-virtual-pipeline-stage``, and ``--sequence-parallel``
turned off when t = 1, as Megatron-LM does, so one configuration moves between layouts (it prints
nothing: ``ptdp.runtime.startup.startup_warnings`` says what was resolved). :func:`layout` gives the
sizes every part of a run agrees on (t, c, p, d, v, m, the schedule), computed once.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from ptdp.config.schema import Config, ConfigError
from ptdp.config.validate_moe import expert_tensor_size
from ptdp.config.validate_pipeline import stages_of, virtual_size
from ptdp.schedule.layout import Stage


@dataclass(frozen=True)
class Layout:
    """The parallel layout of a valid configuration on ``world_size`` processes."""

    tensor_model_parallel_size: int
    context_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    virtual_pipeline_model_parallel_size: int
    num_microbatches: int
    pipeline_schedule: str
    expert_tensor_parallel_size: int
    stages: tuple[Stage, ...]  # the p·v pipeline stages, even or Megatron's uneven layout


def derive(config: Config) -> Config:
    """A copy of ``config`` with its derived values filled in (``config`` itself is not modified).

    Call it on a configuration ``validate`` accepted; ConfigError if a derived value cannot be found.
    """
    v, problems = virtual_size(config)
    if problems or v is None:
        raise ConfigError(*problems)
    out = copy.deepcopy(config)
    if (config.parallel.num_layers_per_virtual_pipeline_stage is not None
            or config.parallel.pipeline_model_parallel_layout is not None):  # v from the layout string
        out.parallel = dataclasses.replace(out.parallel, virtual_pipeline_model_parallel_size=v)
    if out.parallel.sequence_parallel and out.parallel.tensor_model_parallel_size == 1:
        out.parallel = dataclasses.replace(out.parallel, sequence_parallel=False)
    return out


def layout(config: Config, world_size: int) -> Layout:
    """The sizes of a validated, derived configuration on ``world_size`` processes."""
    par, tr = config.parallel, config.training
    t, c, p = par.tensor_model_parallel_size, par.context_parallel_size, par.pipeline_model_parallel_size
    d = world_size // (t * c * p)
    # with --fault-tolerant-replicas R, world_size is one replica group's: it trains 1/R of the global batch
    shares = max(par.fault_tolerant_replicas, 1)
    return Layout(t, c, p, d, par.virtual_size, tr.global_batch_size // (tr.micro_batch_size * d * shares),
                  par.schedule, expert_tensor_size(par.expert_tensor_parallel_size, t),
                  tuple(stages_of(config, p, par.virtual_size)))
