"""The LoRA flags (``LoRAConfig``, docs/lora.md): what ptdp refuses, one line each, instead of training
something else. Nothing here imports torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ptdp.config.schema import LORA_TARGETS
from ptdp.config.validate_moe import expert_tensor_size

if TYPE_CHECKING:
    from ptdp.config.schema import Config


def lora_errors(config: Config) -> list[str]:
    """Every problem of the LoRA flags with the rest of ``config``."""
    lo, m, par = config.lora, config.model, config.parallel
    if lo.lora_rank == 0:
        changed = (lo.lora_dropout != 0.0 or list(lo.lora_target_modules) != list(LORA_TARGETS))
        return ["--lora-dropout and --lora-target-modules apply only with --lora-rank R > 0"] if changed else []
    errors = []
    if lo.lora_rank < 0:
        errors.append(f"--lora-rank must be a positive integer (0: no LoRA), got {lo.lora_rank}")
    if lo.lora_alpha <= 0:
        errors.append(f"--lora-alpha must be positive, got {lo.lora_alpha}")
    if not 0.0 <= lo.lora_dropout < 1.0:
        errors.append(f"--lora-dropout must be in [0, 1), got {lo.lora_dropout}")
    unknown = [t for t in lo.lora_target_modules if t not in LORA_TARGETS]
    if unknown or not lo.lora_target_modules:
        errors.append(f"--lora-target-modules: {unknown[0] if unknown else 'none given'} is not one of "
                      f"{', '.join(LORA_TARGETS)}")
    if m.multi_latent_attention and "linear_qkv" in lo.lora_target_modules:
        errors.append("--lora-target-modules linear_qkv with --multi-latent-attention: multi-latent attention has "
                      "no fused QKV projection; target linear_proj, linear_fc1 and linear_fc2")
    experts = config.moe.num_experts and {"linear_fc1", "linear_fc2"} & set(lo.lora_target_modules)
    if experts and expert_tensor_size(par.expert_tensor_parallel_size, par.tensor_model_parallel_size) > 1:
        errors.append("--lora-target-modules linear_fc1/linear_fc2 adapt the experts too, which is not supported "
                      "with expert tensor parallelism yet: pass --expert-tensor-parallel-size 1, or target "
                      "linear_qkv and linear_proj only")
    if config.precision.fp8_format:
        errors.append("--lora-rank with --fp8-format is not supported yet: the adapters run in the GEMMs' dtype only")
    if par.vocab_barriers:
        errors.append("--lora-rank with --enable-vocab-parallel is not supported yet (the vocabulary passes add the frozen "
                      "embedding's gradients outside autograd)")
    if m.compile:
        errors.append("--lora-rank with --compile is not supported yet")
    return errors
