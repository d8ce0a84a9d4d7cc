"""Megatron-LM flags that have no field of their own in ptdp: a user pastes them from Megatron-LM's scripts.

* ``NO_OP_FLAGS``: accepted and ignored, because what they ask for is what ptdp always does (``--use-flash-attn``:
  ptdp's attention is torch's ``scaled_dot_product_attention``, which runs FlashAttention where the device has
  it; ``--use-mcore-models``: ptdp always builds its own core models);
* ``MAPPED_FLAGS``: Megatron-LM's other spelling of a ptdp setting (``--recompute-activations`` is
  ``--recompute-granularity selective``), applied by :func:`apply_mapped`;
* ``EXPLAINED_FLAGS``: well-known flags ptdp does not implement, refused with one line saying what the flag is
  for in Megatron-LM and what to do in ptdp instead of argparse's bare "unrecognized arguments".

The command line (``ptdp.config.load.add_config_arguments``) and the ``--config`` TOML file take the same names.
"""

from __future__ import annotations

from typing import Any

_IGNORED = "accepted for Megatron-LM compatibility and ignored: "
_NO_FUSED = "ptdp has no such fused kernel to turn off (it fuses only under --compile)"

# flag -> why it changes nothing in ptdp (store_true flags)
NO_OP_FLAGS: dict[str, str] = {
    "--use-flash-attn": "ptdp's attention is torch's scaled_dot_product_attention, which uses FlashAttention "
                        "wherever the device has it",
    "--use-mcore-models": "ptdp always builds its own core models (there are no legacy models to choose from)",
    "--log-throughput": "ptdp's progress line always shows tokens/s and TFLOP/s/GPU",
    "--no-masked-softmax-fusion": _NO_FUSED,
    "--no-bias-dropout-fusion": _NO_FUSED,
    "--no-bias-swiglu-fusion": _NO_FUSED,
    "--no-rope-fusion": _NO_FUSED,
    "--no-gradient-accumulation-fusion": _NO_FUSED,
    "--no-persist-layer-norm": _NO_FUSED,
}

# flag -> (argparse type, help); applied to the configuration by apply_mapped
MAPPED_FLAGS: dict[str, tuple[type, str]] = {
    "--recompute-activations": (bool, "Megatron-LM's shorthand for --recompute-granularity selective"),
    "--lr-warmup-fraction": (float, "warm up over this fraction of the decay iterations (--lr-decay-iters, default "
                                    "--train-iters), rounded down: Megatron-LM's alternative to --lr-warmup-iters"),
}

# flag -> one line: what it does in Megatron-LM, and what to do in ptdp
EXPLAINED_FLAGS: dict[str, str] = {
    "--transformer-impl": "is Megatron-LM's choice between Transformer Engine and its local layers; ptdp has one "
                          "implementation of its own (FP8 through torchao: --fp8-format): drop the flag",
    "--attention-backend": "is Megatron-LM's choice of attention kernel; ptdp's attention is torch's "
                           "scaled_dot_product_attention, which picks the kernel for the device itself: drop the flag",
    "--attention-softmax-in-fp32": "is Megatron-LM's flag for an fp32 softmax in its fused attention softmax; ptdp's "
                                   "attention is torch's scaled_dot_product_attention, whose kernels choose their "
                                   "own precision: drop the flag",
    "--distributed-backend": "is Megatron-LM's choice of process-group backend; ptdp uses NCCL on GPUs and Gloo on the "
                             "CPU by itself: drop the flag",
    "--use-torch-fsdp2": "is Megatron-LM's flag for PyTorch FSDP2; ptdp shards with its own ZeRO: use "
                         "--data-parallel-sharding-strategy optim_grads_params (ZeRO-3)",
    "--overlap-param-gather": "is Megatron-LM's flag for overlapping the distributed optimizer's parameter "
                              "all-gather with the forward; ptdp does not implement it (--overlap-grad-reduce "
                              "overlaps the gradient reduction)",
    "--tp-comm-overlap": "is Megatron-LM's flag for overlapping tensor-parallel communication with the GEMMs "
                         "(Transformer Engine's userbuffers); ptdp does not implement it: drop the flag",
    "--rampup-batch-size": "is Megatron-LM's flag for a global batch size that grows during training; ptdp trains "
                           "with one --global-batch-size throughout",
    "--train-samples": "is Megatron-LM's flag for the training length in samples; ptdp counts iterations: use "
                       "--train-iters (samples / --global-batch-size)",
    "--lr-decay-samples": "is Megatron-LM's flag for the decay length in samples; ptdp counts iterations: use "
                          "--lr-decay-iters (samples / --global-batch-size)",
    "--lr-warmup-samples": "is Megatron-LM's flag for the warm-up length in samples; ptdp counts iterations: use "
                           "--lr-warmup-iters (samples / --global-batch-size) or --lr-warmup-fraction",
    "--exit-duration-in-mins": "is Megatron-LM's flag for stopping after a wall-clock time; ptdp does not implement "
                               "it: use --exit-interval N, or send SIGTERM (ptdp saves and stops)",
    "--num-workers": "is Megatron-LM's number of data-loader worker processes; ptdp reads the memory-mapped "
                     "samples in the training process: drop the flag",
    "--ckpt-format": "is Megatron-LM's checkpoint format (torch, torch_dist, ...); ptdp writes its own format, "
                     "which loads in any layout: drop the flag",
    "--log-params-norm": "is Megatron-LM's flag for logging the parameters' norm; ptdp does not compute it: "
                         "drop the flag",
    "--log-num-zeros-in-grad": "is Megatron-LM's flag for logging the zeros in the gradient; ptdp does not "
                               "compute it: drop the flag",
    "--timing-log-level": "is Megatron-LM's timer verbosity; ptdp has no such timers (--timeline writes a Chrome "
                          "trace of the first iterations): drop the flag",
}


def dest(flag: str) -> str:
    """The argparse destination (and TOML key, with underscores) of ``flag``."""
    return flag.removeprefix("--").replace("-", "_")


def add_megatron_arguments(parser: Any) -> None:
    """The no-op and mapped flags, in a group of their own at the end of ``--help``; default None (not given)."""
    group = parser.add_argument_group("Megatron-LM compatibility (docs/cli.md)")
    for flag, why in NO_OP_FLAGS.items():
        group.add_argument(flag, dest=dest(flag), action="store_true", default=None, help=_IGNORED + why)
    for flag, (typ, help_text) in MAPPED_FLAGS.items():
        if typ is bool:
            group.add_argument(flag, dest=dest(flag), action="store_true", default=None, help=help_text)
        else:
            group.add_argument(flag, dest=dest(flag), type=typ, default=None, help=help_text)


def explanation(flag: str) -> str | None:
    """The one line for a flag ptdp does not implement (``--transformer-impl=local`` too), or None."""
    name = flag.split("=", 1)[0]
    return f"{name} {EXPLAINED_FLAGS[name]}" if name in EXPLAINED_FLAGS else None


def toml_problem(key: str, value: Any) -> tuple[bool, str | None]:
    """Whether ``key`` (underscores) of a ``--config`` file is one of these flags, and its problem if any (a
    value of the wrong type, or an explained flag)."""
    flag = "--" + key.replace("_", "-")
    if flag in EXPLAINED_FLAGS:
        return True, f"{flag} {EXPLAINED_FLAGS[flag]}"
    typ = bool if flag in NO_OP_FLAGS else MAPPED_FLAGS.get(flag, (None,))[0]
    if typ is None:
        return False, None
    if typ is bool and not isinstance(value, bool):
        return True, f"expected true or false, got {value!r}"
    if typ is float and (isinstance(value, bool) or not isinstance(value, int | float)):
        return True, f"expected a number, got {value!r}"
    return True, None


def apply_mapped(config: Any, given: dict[str, Any], explicit: dict[str, Any]) -> list[str]:
    """Set what the mapped flags in ``given`` (by destination, None: not given) mean on ``config``; one problem
    line per contradiction with ``explicit`` (the fields given on the command line or in the file)."""
    problems = []
    if given.get("recompute_activations"):
        granularity = explicit.get("recompute_granularity")
        if granularity not in (None, "selective"):
            problems.append(f"--recompute-activations means --recompute-granularity selective; it contradicts "
                            f"--recompute-granularity {granularity}: give one of them")
        else:
            config.model.recompute_granularity = "selective"
    fraction = given.get("lr_warmup_fraction")
    if fraction is not None:
        if explicit.get("lr_warmup_iters") is not None:
            problems.append("--lr-warmup-fraction and --lr-warmup-iters: give one of them")
        elif not 0.0 <= fraction <= 1.0:
            problems.append(f"--lr-warmup-fraction: expected a fraction in [0, 1], got {fraction}")
        else:
            opt = config.optimizer
            opt.lr_warmup_iters = int(fraction * (opt.lr_decay_iters or config.training.train_iters))
    return problems
