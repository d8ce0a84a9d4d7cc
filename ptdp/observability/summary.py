"""The end-of-run summary rank 0 prints after the last progress line.

Average TFLOP/s per GPU divides the model FLOPs of every iteration run (docs/references.md, §FLOPs) by the
whole wall time of the loop and the GPU count: like the paper's "achieved throughput" it counts
everything (data loading, optimizer, communication, logging, checkpoint saves), not just the steps.
"""

from __future__ import annotations

import math


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    h, minutes = divmod(minutes, 60)
    return f"{h}:{minutes:02d}:{s:02d}"


def best_validation_loss(records: list[dict]) -> float | None:
    """The lowest finite validation loss of any record (keys like ``val_loss``), or None."""
    values = [v for r in records for k, v in r.items()
              if k in ("val_loss", "valid_loss", "validation_loss") and isinstance(v, int | float)
              and math.isfinite(v)]
    return min(values) if values else None


def run_summary(records: list[dict], wall_s: float, world_size: int, iteration_flops: float,
                tokens_per_iteration: int, checkpoint: str | None) -> dict:
    """The summary's numbers (also what the tests read)."""
    iterations = len(records)
    return {
        "iterations": iterations,
        "tokens": iterations * tokens_per_iteration,
        "wall_time_s": wall_s,
        "avg_tflops_per_gpu": iterations * iteration_flops / max(wall_s, 1e-12) / world_size / 1e12,
        "final_loss": records[-1]["loss"] if records else None,
        "best_val_loss": best_validation_loss(records),
        "checkpoint": checkpoint,
    }


def summary_line(summary: dict) -> str:
    parts = [f"iterations: {summary['iterations']}", f"tokens seen: {summary['tokens']:,}",
             f"wall time: {_duration(summary['wall_time_s'])}",
             f"average TFLOP/s/GPU: {summary['avg_tflops_per_gpu']:.4g}"]
    if summary["final_loss"] is not None:
        parts.append(f"final lm loss: {summary['final_loss']:.6E}")
    if summary["best_val_loss"] is not None:
        parts.append(f"best val loss: {summary['best_val_loss']:.6E}")
    if summary["checkpoint"]:
        parts.append(f"checkpoint: {summary['checkpoint']}")
    return " run summary | " + " | ".join(parts)
