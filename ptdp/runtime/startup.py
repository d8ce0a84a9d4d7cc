"""Start-up checks of ``ptdp train``: what the machine and the files must provide, after the configuration
itself passed ``config.validate``.

``validate`` is pure (the configuration and the world size in, every problem out) and ``derive`` returns a
new object without a word; what depends on this machine (an FP8 GPU, torchao, the checkpoint on disk) or
must be said to the user (a flag ``derive`` turned off) is checked and said here, in the launcher and on
every rank before any process group exists, so every rank stops with the same one-line messages.
"""

from __future__ import annotations

from ptdp.config import Config


def startup_problems(config: Config, world_size: int) -> list[str]:
    """Every reason the derived ``config`` cannot start on this machine, one line each (none: it can)."""
    from ptdp.checkpointing.validation import (
        checkpoint_errors,  # not in ptdp.config, which must not import it
    )
    from ptdp.parallel.fp8 import fp8_environment_errors
    from ptdp.parallel.recompute import recompute_environment_errors

    return [*fp8_environment_errors(config), *recompute_environment_errors(config),
            *checkpoint_errors(config, world_size)]


def startup_warnings(given: Config, derived: Config) -> list[str]:
    """One line per flag the user gave that ``derive`` resolved otherwise (Megatron-LM's behaviour, so one
    configuration moves between layouts)."""
    warnings = []
    if given.parallel.sequence_parallel and not derived.parallel.sequence_parallel:
        warnings.append("--sequence-parallel is off because --tensor-model-parallel-size is 1")
    return warnings
