"""``--wandb-project`` (Megatron-LM's flags): the TensorBoard scalars logged to Weights & Biases, by rank 0.

The same tags and values as ``--tensorboard-dir`` (``ptdp.observability.tensorboard.scalars``), one W&B step per
iteration. Without ``WANDB_API_KEY`` in the environment the run is written offline (``WANDB_MODE=offline``,
unless the user set ``WANDB_MODE``) under ``--wandb-save-dir`` (default ``--save DIR/wandb``, as Megatron-LM),
to upload later with ``wandb sync``. ``wandb`` is imported only here, when the flag is given; start-up
(``ptdp.runtime.startup``) refuses the flag in one line when the package is missing.
"""

from __future__ import annotations

import os
from pathlib import Path

from ptdp.config import Config
from ptdp.observability.tensorboard import scalars


def wandb_directory(config: Config) -> str | None:
    """Where the W&B run files go: ``--wandb-save-dir``, else ``--save DIR/wandb``, else wandb's own default
    (``./wandb``)."""
    tr = config.training
    if tr.wandb_save_dir:
        return tr.wandb_save_dir
    return str(Path(config.checkpoint.save) / "wandb") if config.checkpoint.save else None


class WandbLogger:
    """One W&B run for the training run; :meth:`log` each record, :meth:`close` at the end."""

    def __init__(self, config: Config) -> None:
        if not os.environ.get("WANDB_API_KEY"):
            os.environ.setdefault("WANDB_MODE", "offline")  # no account here: write the run for `wandb sync`
        import wandb  # lazy: an optional extra, imported only with --wandb-project

        directory = wandb_directory(config)
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
        tr = config.training
        self.run = wandb.init(project=tr.wandb_project, name=tr.wandb_exp_name or None, dir=directory,
                              config=config.to_dict())

    def log(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["iteration"])

    def close(self) -> None:
        self.run.finish()
