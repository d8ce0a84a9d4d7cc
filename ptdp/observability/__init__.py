"""What a run shows while and after it trains, all optional and rank-0 unless said otherwise:

- ``tensorboard``: ``--tensorboard-dir``: the per-iteration record as TensorBoard scalars (rank 0)
- ``timeline``: ``--timeline DIR``: one Chrome trace per rank of the first iterations, and their merge
- ``summary``: the end-of-run summary line (tokens, wall time, TFLOP/s per GPU, best val loss, checkpoint)
- ``flight_recorder``, ``liveness``, ``watchdog``: every rank's progress (layers, executor actions, GPU
  work, communication) and the hang watchdog that reads it (``--hang-timeout-s``, every rank)

Nothing here imports torch at module level, so ``config.validate`` can call :func:`observability_errors`
in the launcher before any worker exists.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def observability_errors(tensorboard_dir: str | None, timeline_dir: str | None,
                         timeline_iters: int | None) -> list[str]:
    """Problems with ``--tensorboard-dir`` / ``--timeline`` / ``--timeline-iters``, one line each."""
    errors = []
    if tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is None:
        errors.append(f"--tensorboard-dir {tensorboard_dir} needs the tensorboard package: "
                      "pip install 'ptdp[tensorboard]'")
    if timeline_iters is not None and timeline_iters <= 0:
        errors.append(f"--timeline-iters must be a positive integer, got {timeline_iters}")
    for flag, directory in (("--tensorboard-dir", tensorboard_dir), ("--timeline", timeline_dir)):
        if directory is None:
            continue
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            errors.append(f"{flag} {directory} is not a directory (a file is in the way); "
                          "choose a directory path")
        except OSError as e:
            errors.append(f"{flag} {directory} cannot be created ({e.strerror}); choose a writable directory")
    return errors
