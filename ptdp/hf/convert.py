"""``ptdp export`` / ``ptdp import --format hf``: a checkpoint to and from Hugging Face ``transformers``.

Each model family (``ptdp.models.families``: GPT-2, Llama, Mixtral, Qwen2-MoE, Qwen3, Qwen3-MoE,
DeepSeek-V3) holds its own state-dict mapping in its folder (``ptdp/models/<family>/hf.py``); this module
reads and writes the files and picks the family: by config.json's ``model_type`` on import, by the model's
flags on export.

Checkpoints are read and written as full tensors in one process (``ptdp.checkpointing.full_model``), so
an export works from any (t, p, d, v) layout and an imported model trains in any layout. Families with
per-tensor recipes (``ptdp.models.hf_recipe``) export one parameter at a time (``ptdp.hf.streamed``) and
load without an import (``ptdp train --load HF_DIR``, ``ptdp.checkpointing.hf_reader``). ``transformers``
and ``safetensors`` are the optional extra ``pip install 'ptdp[hf]'``, imported only here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ptdp.config import ConfigError, ModelConfig, MoEConfig
from ptdp.models.deepseek_v3 import hf as hf_deepseek
from ptdp.models.families import FAMILIES, family_for_hf, family_of

if TYPE_CHECKING:  # torch loads only when a conversion runs, not for `ptdp --help`
    import torch

    from ptdp.data import Tokenizer
    from ptdp.models import GPTModel
TIED_EMBEDDING = "embedding.word_embeddings.weight"  # = ptdp.models.TIED_EMBEDDING

HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
class HFError(ConfigError):
    """A problem with the files or flags of an export/import; one line naming the flag and the fix."""


def model_config_from_dict(config_dict: dict) -> ModelConfig:
    """The ``ModelConfig`` of a saved config (``Config.to_dict()`` form or just its ``model`` section)."""
    values = dict(config_dict.get("model", config_dict))
    if "layernorm_epsilon" in values:  # checkpoints written before --norm-epsilon
        values.setdefault("norm_epsilon", values.pop("layernorm_epsilon"))
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in values.items() if k in known})


def moe_config_from_dict(config_dict: dict) -> MoEConfig:
    """The ``MoEConfig`` of a saved config (its ``moe`` section; dense when absent)."""
    known = {f.name for f in dataclasses.fields(MoEConfig)}
    return MoEConfig(**{k: v for k, v in config_dict.get("moe", {}).items() if k in known})


def full_model_from_state(tensors: dict[str, torch.Tensor], config_dict: dict) -> GPTModel:
    """A single-process (t = 1) ptdp ``GPTModel`` holding ``tensors``, in eval mode (no dropout)."""
    from ptdp.models import GPTModel
    from ptdp.parallel.tensor.random import MODEL_PARALLEL_RNG, get_rng_tracker

    tracker = get_rng_tracker()
    if MODEL_PARALLEL_RNG not in tracker.states:  # attention forks this stream even without dropout
        tracker.add(MODEL_PARALLEL_RNG, config_dict.get("training", {}).get("seed", 1234))
    cfg = model_config_from_dict(config_dict)
    vocab = cfg.vocab_size or tensors[TIED_EMBEDDING].shape[0]
    model = GPTModel(cfg, vocab, tensors[TIED_EMBEDDING].shape[0], moe_config_from_dict(config_dict))
    if any("adapter.lora_" in name for name in tensors):  # a LoRA run's checkpoint: its adapters attached
        _attach_adapters(model, config_dict)
    model.load_state_dict(tensors, strict=True)
    return model.eval()


def _attach_adapters(model: GPTModel, config_dict: dict) -> None:
    from ptdp.config import LoRAConfig
    from ptdp.parallel.lora import apply_lora
    from ptdp.parallel.placement import Placements

    known = {f.name for f in dataclasses.fields(LoRAConfig)}
    lora = LoRAConfig(**{k: v for k, v in config_dict.get("lora", {}).items() if k in known})
    placements = Placements()
    placements.adopt(model)
    apply_lora(model, lora, placements)


# ---------------------------------------------------------------------------------------------- export

def _special_ids(config_dict: dict, vocab: int) -> tuple[int | None, int | None]:
    """(BOS, end-of-document) ids of the run's tokenizer (the byte tokenizer's None, 256 by default), if knowable."""
    tokenizer = _tokenizer(config_dict, vocab)
    return (None, None) if tokenizer is None else (tokenizer.bos_id, tokenizer.eod_id)


def _tokenizer(config_dict: dict, vocab: int) -> Tokenizer | None:
    from ptdp.data import ByteTokenizer, load_tokenizer
    from ptdp.data.builder import _strip_suffix, parse_data_path

    data = config_dict.get("data", {})
    data_path = data.get("data_path") or data.get("train_data_path") or []  # the run's training data
    try:
        prefixes = parse_data_path(data_path)[0] if data_path else []
        tokenizer = load_tokenizer(_strip_suffix(prefixes[0])) if prefixes else ByteTokenizer()
    except Exception:  # the data may live elsewhere now; the ids stay valid, only eos is unknown
        return None
    return tokenizer if tokenizer.vocab_size == vocab else None


def export_hf(load: str | Path, out: str | Path, merge_lora: bool = False, fmt: str = "hf",
              max_shard_size: str | int | None = None) -> Path:
    """Write ``OUT/config.json`` and the weights (``model.safetensors``, or shards of at most
    ``max_shard_size`` with ``model.safetensors.index.json``) from the newest checkpoint under ``load``, in
    the Hugging Face architecture of the model's family (``ptdp.models.families``). A family with per-tensor
    recipes is streamed one parameter at a time (``ptdp.hf.streamed``); the others convert in one piece. A
    LoRA run's checkpoint: ``merge_lora`` folds the adapters into the weights; ``fmt`` ``"peft"`` writes the
    adapters alone, as PEFT's adapter directory (``ptdp.hf.lora``); both read the whole model."""
    from ptdp.checkpointing.full_model import FullModelReader
    from ptdp.hf import lora as hf_lora
    from ptdp.hf import streamed

    max_bytes = streamed.parse_size(max_shard_size or streamed.DEFAULT_MAX_SHARD_SIZE)
    model = FullModelReader(load)
    config_dict = model.config
    rank, alpha, _ = hf_lora.lora_settings(config_dict)
    adapters = any("adapter.lora_" in name for name in model.sources)
    if adapters and fmt == "hf" and not merge_lora:
        raise HFError(f"--load {load}: the checkpoint holds LoRA adapters; pass --merge-lora (the merged weights) "
                      "or --format peft (the adapters, for peft.PeftModel)")
    if merge_lora and fmt == "peft":
        raise HFError("--merge-lora writes merged weights (--format hf); --format peft writes the adapters alone")
    if merge_lora and not adapters:
        raise HFError(f"--merge-lora: the checkpoint {load} holds no LoRA adapters (trained without --lora-rank)")
    transformers, _ = _require_hf()
    cfg, moe = model_config_from_dict(config_dict), moe_config_from_dict(config_dict)
    family = family_of(cfg, moe)
    if family is None:
        names = ", ".join(f.name for f in FAMILIES)
        raise HFError(f"--load {load}: the model is none of the families Hugging Face export supports ({names}); "
                      "docs/architecture.md says how to add one")
    problem = family.export_problem(cfg, moe)
    if problem:
        raise HFError(f"--load {load}: {problem}")
    tensors = None
    if fmt == "peft" or merge_lora:  # the adapters meet their base weights: the whole model
        tensors = {name: model.tensor(name) for name in model.sources}
        if fmt == "peft":
            return hf_lora.write_peft(tensors, config_dict, family, cfg, moe, Path(out), str(load))
        from ptdp.parallel.lora import merge_lora as merged

        tensors = merged(tensors, alpha / rank)
    bos, eos = _special_ids(config_dict, cfg.vocab_size)
    hf_config = transformers.AutoConfig.for_model(family.hf_model_type, **family.hf_config(cfg, moe, bos, eos))
    (out := Path(out)).mkdir(parents=True, exist_ok=True)
    if tensors is None and family.hf_recipes is not None:
        streamed.write_streamed(model, family, cfg, moe, out, max_bytes)
    else:
        if tensors is None:
            tensors = {name: model.tensor(name) for name in model.sources}
        writer = streamed.ShardWriter(out, max_bytes)
        for name, tensor in family.write(tensors, cfg, moe).items():
            writer.add(name, tensor)
        writer.close()
    hf_config.save_pretrained(str(out))
    return out


# ---------------------------------------------------------------------------------------------- import

def read_hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards its index names."""
    _, safetensors_torch = _require_hf(need_transformers=False)
    if (directory / HF_WEIGHTS).exists():
        files = [directory / HF_WEIGHTS]
    elif (directory / HF_INDEX).exists():
        shards = json.loads((directory / HF_INDEX).read_text())["weight_map"].values()
        files = [directory / name for name in sorted(set(shards))]
    else:
        raise HFError(f"--in {directory}: no {HF_WEIGHTS} (or {HF_INDEX}); save the model with "
                      "save_pretrained(..., safe_serialization=True)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(safetensors_torch.load_file(str(file)))
        except FileNotFoundError:
            raise HFError(f"--in {directory}: {file.name} is missing (named by {HF_INDEX})") from None
        except Exception as e:  # safetensors' SafetensorError (not importable by name in every version)
            if type(e).__name__ != "SafetensorError" and not isinstance(e, (OSError, ValueError)):
                raise
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise HFError(f"--in {directory}: {file} is corrupted or truncated ({reason}); export the model "
                          "again with save_pretrained(..., safe_serialization=True)") from None
    return tensors


def import_hf(directory: str | Path, save: str | Path) -> tuple[Path, ModelConfig]:
    """Write the HF model in ``directory`` as an iteration-0 ptdp checkpoint under ``save``."""
    path, cfg, _ = import_hf_model(directory, save)
    return path, cfg


def import_hf_model(directory: str | Path, save: str | Path) -> tuple[Path, ModelConfig, MoEConfig]:
    """``import_hf``, also returning the mixture-of-experts settings (dense: ``num_experts`` None)."""
    from ptdp.checkpointing import write_full_model_state

    directory = Path(directory)
    try:
        hf_config = json.loads((directory / "config.json").read_text())
    except FileNotFoundError:
        raise HFError(f"--in {directory}: no config.json; give a directory written by save_pretrained") \
            from None
    except json.JSONDecodeError as e:
        raise HFError(f"--in {directory}/config.json is not valid JSON ({e})") from None
    family = family_for_hf(hf_config.get("model_type"))
    if family is None:
        types = ", ".join(repr(f.hf_model_type) for f in FAMILIES)
        raise HFError(f"--in: config.json has model_type {hf_config.get('model_type')!r}; the model types that "
                      f"import are {types}")
    cfg, moe, tensors = family.read(hf_config, read_hf_tensors(directory))
    path = write_full_model_state(save, tensors, {"model": dataclasses.asdict(cfg), "moe": dataclasses.asdict(moe)})
    return path, cfg, moe


# Fields that decide what the imported model computes: ``ptdp train --load`` must be given the same.
_MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
                "norm_epsilon", "qk_layernorm",
                "position_embedding_type", "rotary_base", "use_rope_scaling", "rope_scaling_factor", "normalization",
                "swiglu", "group_query_attention", "num_query_groups", "untie_embeddings_and_output_weights",
                "disable_bias_linear", "kv_channels", "add_qkv_bias", *hf_deepseek.MODEL_FLAGS,
                "window_size", "window_attn_skip_freq", "local_rotary_base", "sandwich_norm", "apply_layernorm_1p",
                "scale_embedding", "geglu", "softmax_scale", "softmax_type", "quick_geglu", "glu_linear_offset",
                "activation_func_clamp_value", "yarn_correction_range_round_to_int", "rotary_percent",
                "attention_output_gate", "experimental_attention_variant", "linear_attention_freq",
                "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                "linear_num_value_heads", "attn_logit_softcapping", "final_logit_softcapping", "openai_gelu",
                "bias_gelu_fusion")
# Boolean fields whose default is True: their flag turns them off (``--no-...``).
_NEGATED = {"yarn_correction_range_round_to_int": "--no-yarn-correction-range-round-to-int",
            "bias_gelu_fusion": "--no-bias-gelu-fusion"}


def train_flags(cfg: ModelConfig, moe: MoEConfig | None = None) -> str:
    """The ``ptdp train`` flags that load an imported model (its shape flags, the Llama options if any, the
    mixture of experts if any)."""
    default = ModelConfig()
    given, defaults = {**dataclasses.asdict(cfg), "ffn_hidden_size": cfg.ffn_size}, dataclasses.asdict(default)
    flags = []
    for name in _MODEL_FLAGS:
        value = given[name]
        flag = "--" + name.replace("_", "-")
        if name in _NEGATED:
            flags += [] if value else [_NEGATED[name]]
        elif isinstance(value, bool):
            flags += [flag] if value else []
        elif value is not None and (name in _MODEL_FLAGS[:6] or value != defaults[name]):
            exact = isinstance(value, float) and float(f"{value:g}") != value  # e.g. Gemma's 20^-1/2: every digit
            flags.append(f"{flag} {value!r}" if exact else f"{flag} {value:g}" if isinstance(value, float)
                         else f"{flag} {value}")
    positions = cfg.max_position_embeddings or cfg.seq_length
    if positions < default.seq_length:  # the default --seq-length would not fit
        flags.append(f"--seq-length {positions}")
    if cfg.rope_scaling_factor == default.rope_scaling_factor and "--use-rope-scaling" not in flags:
        flags = [f for f in flags if not f.startswith("--rope-scaling-factor")]
    if moe is not None and moe.num_experts:
        default_moe = dataclasses.asdict(MoEConfig())
        for name, value in dataclasses.asdict(moe).items():
            if value != default_moe[name]:
                flag = "--" + name.replace("_", "-")
                flags += [flag] if value is True else [f"{flag} {value!r}" if isinstance(value, str) else f"{flag} {value}"]
    return " ".join(flags)


# ---------------------------------------------------------------------------------------------- CLI

def _require_hf(need_transformers: bool = True):
    try:
        import safetensors.torch as safetensors_torch

        transformers = None
        if need_transformers:
            import transformers
    except ImportError as e:
        raise HFError(f"Hugging Face conversion needs {e.name}: pip install 'ptdp[hf]'") from None
    return transformers, safetensors_torch


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--load", required=True,
                        help="checkpoint directory (the --save DIR of a run, any layout)")
    parser.add_argument("--format", default="hf", choices=["hf", "peft", "megatron"],
                        help="output format: hf (Hugging Face, in the model's family: GPT-2, Llama, Mixtral, Qwen2-MoE, "
                             "Qwen3, Qwen3-MoE, DeepSeek-V3, Gemma 3 or GPT-OSS), peft (a LoRA run's adapters, for "
                             "peft.PeftModel) or megatron (a Megatron-LM torch_dist save)")
    parser.add_argument("--merge-lora", action="store_true",
                        help="--format hf of a LoRA run: the weights with the adapters merged in (W + alpha/r B A)")
    parser.add_argument("--out", required=True,
                        help="directory to write config.json and model.safetensors (or its shards and "
                             "model.safetensors.index.json) to")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="largest safetensors file to write, as save_pretrained's max_shard_size (5GB, 500MB, "
                             "2GiB); a larger model is written in shards with model.safetensors.index.json")


def add_import_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", default="hf", choices=["hf", "megatron"],
                        help="input format (Hugging Face: model_type gpt2, llama, mixtral, qwen2_moe, qwen3, qwen3_moe, "
                             "gemma3_text or deepseek_v3; megatron: a Megatron-LM --save directory, torch_dist or torch)")
    parser.add_argument("--in", dest="input", required=True,
                        help="directory with config.json and model.safetensors (save_pretrained)")
    parser.add_argument("--save", required=True, help="checkpoint directory to write (load it with --load)")


def run_export(args: argparse.Namespace) -> int:
    from ptdp.checkpointing import CheckpointError

    try:
        out = export_hf(args.load, args.out, args.merge_lora, args.format, getattr(args, "max_shard_size", None))
    except CheckpointError as e:
        return _fail("export", f"--load {args.load}: {e}")
    except ConfigError as e:
        return _fail("export", str(e))
    if args.format == "peft":
        print(f"wrote {out}/adapter_config.json and {out}/adapter_model.safetensors: "
              f"peft.PeftModel.from_pretrained(base, {str(out)!r})")
        return 0
    weights = HF_INDEX if (out / HF_INDEX).exists() else HF_WEIGHTS
    print(f"wrote {out}/config.json and {out}/{weights}: AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


def run_import(args: argparse.Namespace) -> int:
    try:
        path, cfg, moe = import_hf_model(args.input, args.save)
    except (ConfigError, KeyError) as e:
        return _fail("import", str(e) if isinstance(e, ConfigError) else f"--in: config.json lacks {e}")
    except ValueError as e:  # shapes that contradict config.json
        return _fail("import", f"--in {args.input}: {e}")
    print(f"wrote {path}; continue training with: ptdp train --load {args.save} {train_flags(cfg, moe)} "
          f"{_data_flags(Path(args.input), cfg.vocab_size)}")
    return 0


def _data_flags(directory: Path, vocab_size: int) -> str:
    """The vocabulary (and tokenizer) flags the printed command needs: the model's vocabulary, and the HF
    tokenizer saved beside the weights when there is one (else the run's data brings its own tokenizer)."""
    tokenizer = (f" --tokenizer-type HuggingFaceTokenizer --tokenizer-model {directory}"
                 if (directory / "tokenizer.json").is_file() else "")
    return f"--vocab-size {vocab_size}{tokenizer}"


def _fail(command: str, message: str) -> int:
    from ptdp.runtime.errors import error_line

    sys.stderr.write(error_line(command, message))
    return 2
