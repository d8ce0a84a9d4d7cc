"""``ptdp export --format megatron``: a ptdp checkpoint as a Megatron-LM ``torch_dist`` save.

Written in one process as Megatron-Core's ``dist_checkpointing`` lays it out, so Megatron-LM loads it in any
(t, p) (``--finetune``, or ``--no-load-optim --no-load-rng``; ``--use-checkpoint-args`` rebuilds the model):

- ``latest_checkpointed_iteration.txt`` reading ``release`` and the save in ``release/`` (Megatron-LM's name
  for a model that no run of its own wrote; it starts at iteration 0);
- ``release/metadata.json`` (backend ``torch_dist``), ``release/common.pt`` (``args``, ``iteration`` 0,
  ``checkpoint_version``) and a PyTorch distributed checkpoint of the full tensors under Megatron-Core's
  names, the layers stacked along a first axis (``ShardedTensor``'s layer axis), the local experts along a
  second; Megatron reads each rank's piece by its global offsets;
- each linear's ``_extra_state`` object (empty for Megatron-Core's local layers), which its loader asks for.
"""

from __future__ import annotations

import argparse
import json
import re
import warnings
from pathlib import Path

from ptdp.megatron.args import MegatronError, args_from_model, export_problem
from ptdp.megatron.names import LAYER, to_megatron
from ptdp.megatron.read import COMMON, METADATA, TRACKER

CHECKPOINT_VERSION = 3.0  # Megatron-LM's current checkpoint_version (QKV interleaved per query group)
_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")


def export_megatron(load: str | Path, out: str | Path) -> Path:
    """Write the newest checkpoint under ``load`` as a Megatron-LM ``torch_dist`` save in ``out``."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ptdp.checkpointing import read_full_model_state
    from ptdp.hf.convert import model_config_from_dict, moe_config_from_dict

    tensors, config_dict = read_full_model_state(load)
    cfg, moe = model_config_from_dict(config_dict), moe_config_from_dict(config_dict)
    problem = export_problem(cfg, moe)
    if problem:
        raise MegatronError(f"--load {load}: {problem}")
    out = Path(out)
    if (out / TRACKER).exists():
        raise MegatronError(f"--out {out} already holds a Megatron-LM save ({TRACKER}); give a fresh directory")
    per_layer = to_megatron(tensors, cfg, moe)
    state: dict[str, object] = {}
    layers: dict[str, dict[int, torch.Tensor]] = {}
    experts: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
    for name, value in per_layer.items():
        match = LAYER.match(name)
        if match is None:
            state[name] = value
            continue
        i, suffix = int(match.group(1)), match.group(2)
        expert = _EXPERT.match(suffix)
        if expert:
            experts.setdefault(expert.group(2), {})[(i, int(expert.group(1)))] = value
        else:
            layers.setdefault(suffix, {})[i] = value
    for suffix, per in layers.items():
        if sorted(per) != list(range(cfg.num_layers)):
            raise MegatronError(f"--load {load}: {suffix} is in some layers only; Megatron stacks every layer's")
        state[f"decoder.layers.{suffix}"] = torch.stack([per[i] for i in range(cfg.num_layers)])
    for suffix, per in experts.items():
        count = moe.num_experts
        state[f"decoder.layers.mlp.experts.experts.{suffix}"] = torch.stack(
            [torch.stack([per[(i, e)] for e in range(count)]) for i in range(cfg.num_layers)])
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}
    linears = [lin for lin in _LINEARS if f"decoder.layers.{lin}.weight" in state]
    for lin in linears:  # the loader reads every linear's extra state: a list of the ranks' objects (None each)
        for i in range(cfg.num_layers):
            state[f"decoder.layers.{lin}._extra_state/shard_{i}_{cfg.num_layers}"] = [None]
    for suffix in experts:  # and every expert's, by (layer, expert)
        lin, count = suffix.removesuffix(".weight"), moe.num_experts
        for i in range(cfg.num_layers):
            for e in range(count):
                state[f"decoder.layers.mlp.experts.experts.{lin}._extra_state/shard_{i}.{e}_{cfg.num_layers}.{count}"] = [None]
    directory = out / "release"
    directory.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=directory, no_dist=True)
    padded = per_layer["embedding.word_embeddings.weight"].shape[0]
    args = argparse.Namespace(**args_from_model(cfg, moe, padded), tensor_model_parallel_size=1,
                              pipeline_model_parallel_size=1, iteration=0, consumed_train_samples=0)
    torch.save({"args": args, "iteration": 0, "checkpoint_version": CHECKPOINT_VERSION}, directory / COMMON)
    (directory / METADATA).write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                  "common_backend": "torch", "common_backend_version": 1}))
    (out / TRACKER).write_text("release")
    return directory
