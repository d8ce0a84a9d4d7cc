"""LoRA checkpoints out to Hugging Face: merged weights (``ptdp export --format hf --merge-lora``) or a PEFT
adapter directory (``ptdp export --format peft``) that ``peft.PeftModel.from_pretrained`` loads over the
base model ``ptdp export --format hf`` writes of the base checkpoint.

ptdp fuses projections HF keeps apart (QKV as q/k/v; fc1 as gate/up). A fused linear's adapter has one
``A`` (the input side is shared) and one ``B`` whose rows are the fused weight's rows, so each HF projection
gets that same ``A`` and its own rows of ``B``: exactly the rows the family's own conversion
(``ModelFamily.write``) picks from the weight. Those rows are found by running that conversion on the weights
with ``B`` written into their first r columns -- whatever grouped-query order or permutation the family
applies to rows, ``B`` follows it, and no family repeats the mapping here. The input side (``A``) is never
permuted by the families that export to PEFT (their input features are the hidden size or the heads in
order).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ptdp.config import ConfigError, ModelConfig, MoEConfig
from ptdp.parallel.lora import is_adapter

if TYPE_CHECKING:
    import torch

    from ptdp.models.family import ModelFamily

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# ptdp's linear (inside ``layers.N``) -> the HF modules (inside ``model.layers.N``) of the families whose
# HF model names its projections as Llama does
HF_MODULES = {
    "attention.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attention.proj": ("self_attn.o_proj",),
    "mlp.fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.fc2": ("mlp.down_proj",),
}
PEFT_MODEL_TYPES = ("llama", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma3_text")


def lora_settings(config_dict: dict) -> tuple[int, float, float]:
    """(rank, alpha, dropout) of a checkpoint's saved config; rank 0: the run had no LoRA."""
    lora = config_dict.get("lora", {})
    return int(lora.get("lora_rank", 0)), float(lora.get("lora_alpha", 32.0)), float(lora.get("lora_dropout", 0.0))


def _adapted(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names of the adapted linears (``layers.3.mlp.fc1``)."""
    return sorted(name.removesuffix(".adapter.lora_A") for name in tensors if name.endswith(".adapter.lora_A"))


def write_peft(tensors: dict[str, torch.Tensor], config_dict: dict, family: ModelFamily, cfg: ModelConfig,
               moe: MoEConfig, out: Path, load: str) -> Path:
    """Write ``OUT/adapter_config.json`` and ``OUT/adapter_model.safetensors`` (PEFT's names) from a LoRA
    checkpoint's full tensors."""
    import torch
    from safetensors.torch import save_file

    rank, alpha, dropout = lora_settings(config_dict)
    linears = _adapted(tensors)
    if not rank or not linears:
        raise ConfigError(f"--load {load}: the checkpoint holds no LoRA adapters (trained without --lora-rank); "
                          "export it with --format hf")
    if any(name.endswith("_adapter.lora_A") for name in tensors):
        raise ConfigError(f"--format peft: the checkpoint {load} holds the experts' adapters, which PEFT's LoRA (on "
                          "nn.Linear modules) cannot hold; export merged weights with --format hf --merge-lora")
    if family.hf_model_type not in PEFT_MODEL_TYPES:
        raise ConfigError(f"--format peft: the model is {family.name}, whose HF modules ptdp does not map to PEFT's "
                          f"(it does for {', '.join(PEFT_MODEL_TYPES)}); export merged weights with --format hf "
                          "--merge-lora")
    rows = dict(tensors)  # each adapted weight := B in its first r columns
    for linear in linears:
        weight, b = tensors[f"{linear}.weight"], tensors[f"{linear}.adapter.lora_B"]
        rows[f"{linear}.weight"] = torch.cat([b, weight.new_zeros(*b.shape[:-1], weight.shape[-1] - rank)], -1)
    hf_rows = family.write({k: v for k, v in rows.items() if not is_adapter(k)}, cfg, moe)
    state, targets = {}, set()
    for linear in linears:
        layer, _, inside = linear.partition(".")[2].partition(".")
        a = tensors[f"{linear}.adapter.lora_A"]
        for module in HF_MODULES[inside]:
            key = f"base_model.model.model.layers.{layer}.{module}"
            state[f"{key}.lora_A.weight"] = a.float().clone()  # one tensor per HF module (safetensors shares none)
            state[f"{key}.lora_B.weight"] = hf_rows[f"model.layers.{layer}.{module}.weight"][:, :rank].contiguous()
            targets.add(module.rpartition(".")[2])
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / PEFT_WEIGHTS), metadata={"format": "pt"})
    pretrained = config_dict.get("checkpoint", {}).get("pretrained_checkpoint")
    (out / PEFT_CONFIG).write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": dropout,
        "target_modules": sorted(targets), "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "base_model_name_or_path": pretrained,
    }, indent=2) + "\n")
    return out
