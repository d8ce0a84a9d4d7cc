"""``--fault-tolerant-replicas``' problems, one line each naming the flag. Pure: whether torchft is
installed is a start-up check (``ptdp.runtime.replicas``).

What a replica group cannot do yet is refused rather than trained differently: the cross-replica average is
of the gradients each group's optimizer reads, so every step must end in one update of whole (not
ZeRO-3-sharded) weights, and the loss normalisation must be one a group computes alone.
"""

from __future__ import annotations

from ptdp.config.schema import Config


def replica_errors(config: Config) -> list[str]:
    """Every problem of ``--fault-tolerant-replicas`` with the rest of ``config``."""
    par = config.parallel
    replicas = par.fault_tolerant_replicas
    if replicas == 1:
        return []
    if replicas < 1:
        return [f"--fault-tolerant-replicas must be a positive integer, got {replicas}"]
    errors = []
    if par.fault_tolerant_timeout_s <= 0:
        errors.append(f"--fault-tolerant-timeout-s must be positive, got {par.fault_tolerant_timeout_s}")
    refused = (
        (config.optimizer.sharding == "optim_grads_params", "--data-parallel-sharding-strategy optim_grads_params "
         "(ZeRO-3: a recovering group needs whole weights from its peer)"),
        (config.training.calculate_per_token_loss, "--calculate-per-token-loss (its token count spans the groups)"),
        (config.precision.fp16, "--fp16 (an overflow skip must be agreed across the groups)"),
    )
    for hit, what in refused:
        if hit:
            errors.append(f"--fault-tolerant-replicas {replicas} does not work with {what}; use --bf16 or fp32 "
                          "and ZeRO 0-2 with Megatron's loss normalisation")
    return errors
