"""Start-up checks of ``ptdp train``: what the machine and the files must provide, after the configuration
itself passed ``config.validate``.

``validate`` is pure (the configuration and the world size in, every problem out, nothing touched) and
``derive`` returns a new object without a word; what depends on this machine or on disk, or must be said to the
user (a flag ``derive`` turned off), is checked and said at start-up. The CLI runs the checks in order
(``ptdp.cli.main.start_problems``): the ones here (the tensorboard package, the ``--tensorboard-dir`` and
``--timeline`` directories, created now), then each feature's own, which live with the feature: the FP8 GPU
(``ptdp.parallel.fp8``), the datasets' ``.bin``/``.idx`` and the tokenizer's files (``ptdp.data.files``) and
the checkpoint on disk (``ptdp.checkpointing.validation``). ptdp's launcher checks everything before any
worker starts (on one node it also hashes the whole checkpoint, with a few threads, and tells the workers
it did); its workers then skip the files it checked, and a process started otherwise (one process, plain
torchrun) checks everything itself, every rank before any process group exists, so every rank stops with
the same one-line messages (exit 2). The runtime sits low in the package (every layer announces its phases
and prints its errors through it), so it calls nothing above it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ptdp.config import Config


def startup_problems(config: Config) -> list[str]:
    """``--tensorboard-dir`` and ``--wandb-project`` (the package must be installed), ``--timeline`` and
    ``--wandb-save-dir``: each directory created now, so a path that cannot be one is a line here rather than
    a traceback on rank 0 mid-run."""
    tr, errors = config.training, []
    if config.precision.fp16 and not _gpu():  # the device is the GPU when one is visible (parallel.dims)
        errors.append("--fp16 needs a CUDA GPU and none is visible (on the CPU fp16 training is slow and its "
                      "steps overflow: grad norm nan); train in fp32 there (no precision flag), or with --bf16")
    if tr.tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is None:
        errors.append(f"--tensorboard-dir {tr.tensorboard_dir} needs the tensorboard package: "
                      "pip install 'ptdp[tensorboard]'")
    if tr.wandb_project is not None and importlib.util.find_spec("wandb") is None:
        errors.append(f"--wandb-project {tr.wandb_project} needs the wandb package: pip install 'ptdp[wandb]'")
    for flag, given in (("--wandb-exp-name", tr.wandb_exp_name), ("--wandb-save-dir", tr.wandb_save_dir)):
        if given is not None and tr.wandb_project is None:
            errors.append(f"{flag} {given} is for a Weights & Biases run: give --wandb-project too")
    wandb_dir = tr.wandb_save_dir if tr.wandb_project is not None else None
    for flag, directory in (("--tensorboard-dir", tr.tensorboard_dir), ("--timeline", tr.timeline),
                            ("--wandb-save-dir", wandb_dir)):
        if directory is None:
            continue
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            errors.append(f"{flag} {directory} is not a directory (a file is in the way); choose a directory path")
        except OSError as e:
            errors.append(f"{flag} {directory} cannot be created ({e.strerror}); choose a writable directory")
    return errors


def startup_warnings(given: Config, derived: Config) -> list[str]:
    """One line per flag the user gave that ``derive`` resolved otherwise (Megatron-LM's behaviour, so one
    configuration moves between layouts), or that works but slowly on this machine (``--bf16`` on the CPU)."""
    warnings = []
    if given.precision.bf16 and not _gpu():
        warnings.append("--bf16 on the CPU: it trains, but much slower than fp32 there (no GPU is visible); "
                        "drop --bf16 for CPU runs")
    if given.parallel.sequence_parallel and not derived.parallel.sequence_parallel:
        warnings.append("--sequence-parallel is off because --tensor-model-parallel-size is 1")
    return warnings


def _gpu() -> bool:
    """Whether training runs on a GPU: ``ptdp.parallel.dims`` takes one whenever CUDA sees one."""
    import torch  # at start-up torch is imported already (``ptdp train``'s "importing torch" phase)

    return torch.cuda.is_available()
