"""Start-up checks of ``ptdp train``: what the machine and the files must provide, after the configuration
itself passed ``config.validate``.

``validate`` is pure (the configuration and the world size in, every problem out) and ``derive`` returns a
new object without a word; what depends on this machine (an FP8 GPU, torchao) or on the files (the
datasets' ``.bin``/``.idx``, the tokenizer's files, the checkpoint to load) or must be said to the user
(a flag ``derive`` turned off) is checked and said here. The launcher checks everything before any
worker starts (on one node it also hashes the whole checkpoint, with a few threads, and tells the workers
it did); the workers of ptdp's launcher then skip what it checked, and a process started otherwise
(one process, plain torchrun) checks everything itself, every rank before any process group exists, so
every rank stops with the same one-line messages.
"""

from __future__ import annotations

import os
from pathlib import Path

from ptdp.config import Config


def startup_problems(config: Config, world_size: int, launcher: bool = False, one_node: bool = True) -> list[str]:
    """Every reason the derived ``config`` cannot start on this machine, one line each (none: it can).
    ``launcher``: this is ptdp's launcher (``one_node``: without a multi-node rendezvous)."""
    from ptdp.checkpointing.validation import (
        checkpoint_errors,  # not in ptdp.config, which must not import it
    )
    from ptdp.parallel.fp8 import fp8_environment_errors
    from ptdp.runtime.interrupt import launched

    errors = [*fp8_environment_errors(config)]
    if launcher or not launched():  # the launcher's workers: it checked the files already
        from ptdp.data.files import data_file_errors

        errors += data_file_errors(config)
    hash_data = True if launcher and one_node else None  # None: one process hashes, ranks share the work
    errors += checkpoint_errors(config, world_size, hash_data=hash_data)
    if launcher and not errors and config.checkpoint.load:
        _share_verification(Path(config.checkpoint.load))
    return errors


def _share_verification(load: Path) -> None:
    """Tell the workers (through their environment) that the launcher hashed this checkpoint whole."""
    from ptdp.checkpointing.storage import VERIFIED_ENV, CheckpointError, resolve, verified_token

    try:
        directory = resolve(load)
    except CheckpointError:
        return
    token = verified_token(directory) if directory is not None else None
    if token:
        os.environ[VERIFIED_ENV] = token


def startup_warnings(given: Config, derived: Config) -> list[str]:
    """One line per flag the user gave that ``derive`` resolved otherwise (Megatron-LM's behaviour, so one
    configuration moves between layouts)."""
    warnings = []
    if given.parallel.sequence_parallel and not derived.parallel.sequence_parallel:
        warnings.append("--sequence-parallel is off because --tensor-model-parallel-size is 1")
    return warnings
