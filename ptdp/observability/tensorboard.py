"""``--tensorboard-dir``: the training record as TensorBoard scalars, written by rank 0 only.

The record is the one ``ptdp.train.loop`` already builds per iteration (and appends to ``--metrics-file``),
so TensorBoard, the metrics file and the progress line always show the same numbers.
"""

from __future__ import annotations

import resource
import sys

import torch

# record key -> TensorBoard tag; keys absent from a record (e.g. no validation yet) are skipped
SCALARS = {
    "loss": "train/loss",
    "lr": "train/learning_rate",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "throughput/tokens_per_s",
    "tflops_per_gpu": "throughput/tflops_per_gpu",
    "mfu": "throughput/mfu",
    "iteration_time_s": "throughput/iteration_time_s",
    "bubble_fraction": "pipeline/bubble_fraction",
    "peak_activation_bytes": "memory/peak_activation_bytes",
    "moe_aux_loss": "moe/aux_loss",  # mixture of experts (ptdp/train/moe_metrics.py)
    "moe_z_loss": "moe/z_loss",
    "moe_max_load_ratio": "moe/max_load_over_mean",
    "moe_dropped_tokens": "moe/dropped_tokens",
    "mtp_loss": "train/mtp_loss",  # multi-token prediction
}
VALIDATION_PREFIX = "val_"  # present on evaluation iterations: val_loss -> val/loss, val_ppl -> val/ppl


def peak_memory_bytes() -> int:
    """Peak accelerator memory allocated by this process, or its peak resident set size on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss if sys.platform == "darwin" else rss * 1024


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def scalars(record: dict) -> dict[str, float]:
    """The scalars of one training record by tag (``SCALARS``, the validation values under ``val/`` and the
    peak memory): what TensorBoard and Weights & Biases both log."""
    out = {tag: record[key] for key, tag in SCALARS.items() if _is_number(record.get(key))}
    out.update({"val/" + key.removeprefix(VALIDATION_PREFIX): value for key, value in record.items()
                if key.startswith(VALIDATION_PREFIX) and _is_number(value)})
    out["memory/peak_bytes"] = peak_memory_bytes()
    return out


class TensorBoardLogger:
    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard is an optional extra

        self.writer = SummaryWriter(log_dir=log_dir)

    def log(self, record: dict) -> None:
        step = record["iteration"]
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
