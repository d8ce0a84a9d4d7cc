"""Checks of feature flags that are properties of the configuration alone (pure, part of ``validate``):
the recompute (with ZeRO-R's kept-input flags) and FP8 flags. They live here rather than beside the features (``ptdp.parallel.recompute``,
``ptdp.parallel.fp8``), which sit above ``ptdp.config`` and import torch: ``config`` imports nothing above it, so
the package has no import cycle. What the machine must provide is a start-up check (``ptdp.cli.main.start_problems``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ptdp.config.schema import Config

GRANULARITIES = ("full", "selective")
METHODS = ("uniform", "block")
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "rowwise")


def recompute_errors(granularity: str | None, method: str | None, recompute_num_layers: int | None,
                     layers_per_chunk: int) -> list[str]:
    """Problems with the recompute flags, one line each naming the flag and the fix."""
    if granularity is not None and granularity not in GRANULARITIES:
        return [f"--recompute-granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}"]
    if granularity != "full":
        unused = [flag for flag, value in (("--recompute-method", method),
                                           ("--recompute-num-layers", recompute_num_layers)) if value is not None]
        return [f"{flag} applies only to --recompute-granularity full; add it or drop {flag}" for flag in unused]
    errors = []
    if method is not None and method not in METHODS:
        errors.append(f"--recompute-method must be one of {', '.join(METHODS)}, got {method!r}")
    n = recompute_num_layers
    if n is not None and method == "block" and not 0 <= n <= layers_per_chunk:
        errors.append(f"--recompute-num-layers {n} must be between 0 and the {layers_per_chunk} layers of each "
                      "model chunk with --recompute-method block")
    elif n is not None and method != "block" and n < 1:
        errors.append(f"--recompute-num-layers must be >= 1 with --recompute-method uniform, got {n}")
    return errors


def saved_activation_errors(config: Config) -> list[str]:
    """ZeRO-R's flags for the kept layer inputs of full recomputation (``ptdp.parallel.recompute``)."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    errors = [f"{flag} applies only to --recompute-granularity full; add it or drop {flag}"
              for flag, on in (("--distribute-saved-activations", m.distribute_saved_activations),
                               ("--checkpoint-in-cpu", m.checkpoint_in_cpu))
              if on and m.recompute_granularity != "full"]
    if errors or not m.distribute_saved_activations:
        return errors
    if tp == 1:
        errors.append("--distribute-saved-activations needs --tensor-model-parallel-size > 1 (it splits each "
                      "checkpointed layer input over the tensor-parallel ranks)")
    elif config.parallel.sequence_parallel:
        errors.append("--distribute-saved-activations cannot be used with --sequence-parallel: the layer inputs "
                      "are split 1/t over the tensor-parallel ranks already")
    return errors


def fp8_errors(config: Config) -> list[str]:
    """One line per problem of the ``--fp8-*`` flags themselves (none without ``--fp8-format``): pure. What the machine
    must have is ``ptdp.parallel.fp8.fp8_environment_errors``."""
    mp = config.precision
    fmt = mp.fp8_format
    if not fmt:
        return []
    if fmt not in FP8_FORMATS or mp.fp8_recipe not in FP8_RECIPES:
        return [f"--fp8-format {fmt} --fp8-recipe {mp.fp8_recipe}: expected one of {', '.join(FP8_FORMATS)} and "
                f"one of {', '.join(FP8_RECIPES)}"]
    if mp.fp8_recipe == "rowwise" and fmt == "hybrid":  # torchao's rowwise GEMMs take e4m3 operands only
        return ["--fp8-recipe rowwise needs --fp8-format e4m3 (rowwise-scaled FP8 GEMMs take e4m3 operands)"]
    if not mp.bf16:
        return ["--fp8-format needs --bf16 (FP8 GEMMs take bf16 operands and the layers outside them stay bf16)"]
    return []
