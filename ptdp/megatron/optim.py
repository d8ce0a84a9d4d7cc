"""The Megatron distributed optimizer's state, read from a ``torch_dist`` save into ptdp's per-parameter form.

Megatron-Core (``DistributedOptimizer.sharded_state_dict``) saves the Adam state in one of several formats,
named in ``common.pt`` (``optimizer.param_state_sharding_type``):

- ``fully_reshardable`` (Megatron-LM's ``--dist-ckpt-optim-fully-reshardable``): per parameter, tensors
  keyed ``optimizer.state.<field>.<the parameter's key>`` with the parameter's own global shape (layers
  stacked as the model's are), fields ``exp_avg``, ``exp_avg_sq`` and the fp32 main weights (``param``).
  These map onto parameters exactly as the model's tensors do, so ptdp imports them.
- ``dp_reshardable`` (Megatron-LM's default) and ``dp_zero_gather_scatter``: the flat gradient buffers of
  each data-parallel rank (or gathered on rank 0), whose order and padding are Megatron's bucket layout,
  not written in the checkpoint. ptdp refuses them by name.
- ``fully_sharded_model_space`` (megatron-core's own default when no format is asked for): flattened
  pieces of each parameter. megatron-core 0.16.1 cannot save it (``flattened_range is not supported``);
  an older version's is refused by name, unverified.

Adam's step count is not a tensor: it is each param group's ``step`` in ``common.pt``'s
``optimizer.optimizer.param_groups``. The LR scheduler's position (``opt_param_scheduler.num_steps``,
counted in samples) must be the run's consumed samples: ptdp's learning rate is a function of the
iteration, so the import checks that they agree and prints the scheduler's flags.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ptdp.megatron.args import MegatronError

if TYPE_CHECKING:
    import torch

    from ptdp.config import ModelConfig, MoEConfig


class MegatronCheckpoint(Protocol):
    """What is read here of a save (``ptdp.megatron.read.MegatronCheckpoint``, which imports this module)."""

    directory: Path
    args: dict[str, Any]
    optimizer: dict[str, dict[str, Any]]
    common: dict[str, Any]

STATE_PREFIX = "optimizer.state."
SUPPORTED = ("fully_reshardable",)


def _sharding_type(common: Any) -> str | None:
    optimizer = common.get("optimizer") if isinstance(common, dict) else None
    return optimizer.get("param_state_sharding_type") if isinstance(optimizer, dict) else None


def check_optimizer_format(directory: Path, common: Any, entries: dict) -> None:
    """Refuse, in one line naming the format, an optimizer state ptdp cannot map onto parameters."""
    kind = _sharding_type(common)
    if kind is None:
        buckets = any(key.startswith("optimizer.distributed.") for key in entries)
        kind = "dp_reshardable" if buckets else None
    if kind in SUPPORTED and any(key.startswith(STATE_PREFIX) for key in entries):
        return
    what = f"in the {kind!r} format" if kind else "in a format ptdp does not know (no per-parameter state)"
    raise MegatronError(f"--in {directory}: holds the distributed optimizer's state {what}, laid out by Megatron's "
                        f"gradient buffers or as flattened pieces; ptdp imports {' and '.join(map(repr, SUPPORTED))} (save with Megatron-LM's "
                        "--dist-ckpt-optim-fully-reshardable), or pass --no-load-optim to start the optimizer afresh")


def adam_steps(ckpt: MegatronCheckpoint) -> int:
    """The Adam step count every param group agrees on (common.pt's param groups)."""
    optimizer = ckpt.common.get("optimizer", {}).get("optimizer", {})
    steps = {group.get("step") for group in optimizer.get("param_groups", [])}
    if len(steps) != 1 or None in steps:
        raise MegatronError(f"--in {ckpt.directory}: common.pt's optimizer param groups give Adam steps "
                            f"{sorted(map(str, steps))}, not one count")
    return int(steps.pop())


def check_optimizer_args(ckpt: MegatronCheckpoint, consumed: int) -> dict[str, Any]:
    """Refuse what ptdp's AdamW and LR schedule would not continue exactly; the optimizer flags (Megatron's
    names) the run goes on with, its scheduler's where ``common.pt`` holds one."""
    args, where = ckpt.args, f"--in {ckpt.directory}"
    for name, allowed in (("optimizer", "adam"), ("decoupled_weight_decay", True), ("fp16", False),
                          ("weight_decay_incr_style", "constant"), ("lr_warmup_fraction", None),
                          ("lr_warmup_samples", 0), ("lr_warmup_init", 0.0), ("lr_decay_samples", None), ("train_samples", None),
                          ("use_precision_aware_optimizer", False), ("optimizer_cpu_offload", False)):
        value = args.get(name, allowed)
        if value != allowed and not (allowed in (None, 0, False) and not value):
            raise MegatronError(f"{where}: the checkpoint's args set {name}={value!r}; ptdp does not continue that "
                                "optimizer exactly (pass --no-load-optim to start afresh)")
    flags = {k: args[k] for k in ("lr", "min_lr", "lr_decay_style", "lr_warmup_iters", "lr_decay_iters",
                                  "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad")
             if args.get(k) is not None}
    scheduler = ckpt.common.get("opt_param_scheduler")
    if isinstance(scheduler, dict):
        if int(scheduler.get("num_steps", consumed)) != consumed:
            raise MegatronError(f"{where}: opt_param_scheduler num_steps {scheduler['num_steps']} is not the "
                                f"consumed samples {consumed}; ptdp's schedule stands at the iteration")
        if scheduler.get("start_wd") != scheduler.get("end_wd"):
            raise MegatronError(f"{where}: opt_param_scheduler changes the weight decay ({scheduler.get('start_wd')} "
                                f"to {scheduler.get('end_wd')}); ptdp's is constant")
        batch = int(args.get("global_batch_size") or 1)
        flags.update(lr=scheduler.get("max_lr", flags.get("lr")), min_lr=scheduler.get("min_lr", flags.get("min_lr")),
                     lr_decay_style=scheduler.get("lr_decay_style", flags.get("lr_decay_style")),
                     weight_decay=scheduler.get("end_wd", flags.get("weight_decay")))
        for key, name in (("lr_warmup_steps", "lr_warmup_iters"), ("lr_decay_steps", "lr_decay_iters")):
            if scheduler.get(key) is not None:  # counted in samples there, in iterations here
                if int(scheduler[key]) % batch:
                    raise MegatronError(f"{where}: opt_param_scheduler {key} {scheduler[key]} is not a whole number "
                                        f"of global batches ({batch}); ptdp's schedule counts iterations")
                flags[name] = int(scheduler[key]) // batch
    if flags.get("lr_decay_style", "linear") not in ("cosine", "linear", "constant"):
        raise MegatronError(f"{where}: lr_decay_style {flags['lr_decay_style']!r}; ptdp decays cosine, linear or "
                            "constant (pass --no-load-optim to start afresh)")
    return flags


def optimizer_to_ptdp(ckpt: MegatronCheckpoint, cfg: ModelConfig, moe: MoEConfig, rows: int) -> dict[str, dict]:
    """``{ptdp parameter name: {exp_avg, exp_avg_sq, step[, main_param]}}`` from the save's per-parameter
    state; ``rows``: the vocabulary rows ptdp keeps (Megatron padded for its t)."""
    import torch

    from ptdp.megatron.names import to_ptdp

    steps = torch.tensor(float(adam_steps(ckpt)))
    fields = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
    if ckpt.args.get("bf16"):  # 16-bit weights: the fp32 master copy is the truth ptdp resumes from
        fields["param"] = "main_param"
    missing = [name for name in ("exp_avg", "exp_avg_sq") if name not in ckpt.optimizer]
    if missing:
        raise MegatronError(f"--in {ckpt.directory}: the optimizer's state has no {missing[0]} (Adam's); it holds "
                            f"{sorted(ckpt.optimizer)}")
    out: dict[str, dict[str, torch.Tensor]] = {}
    for theirs, ours in fields.items():
        if theirs not in ckpt.optimizer:
            continue
        for name, value in to_ptdp(ckpt.optimizer[theirs], cfg, moe).items():
            if name in ("embedding.word_embeddings.weight", "lm_head.weight") and value.shape[0] > rows:
                value = value[:rows]
            out.setdefault(name, {"step": steps})[ours] = value.float()
    return out
