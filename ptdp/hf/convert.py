"""Hugging Face ``transformers`` GPT-2 export and import: ``ptdp export`` / ``ptdp import``.

(Llama-family models — ``model_type`` "llama" — convert in ``ptdp.hf.llama``, Mixtral and Qwen2-MoE in
``ptdp.hf.moe``; this module dispatches.)

ptdp's GPT *is* the GPT-2 architecture (pre-LN, learned positions, GeLU-tanh MLP, tied embedding; see
ptdp/models/gpt.py), so conversion is a renaming plus three layout changes:

- HF GPT-2 uses ``Conv1D`` layers whose weights are ``[in, out]``; ptdp's linears are ``[out, in]``.
- ptdp's fused QKV weight is ``[3, h, h]`` (q, k, v blocks, heads contiguous in each) and HF's ``c_attn``
  is ``[h, 3h]`` with the same q|k|v column order, so it is a flatten and a transpose.
- ptdp pads the vocabulary (``--make-vocab-size-divisible-by``, and t); HF holds only the real rows.
  Token ids are not remapped: the byte-level tokenizer's ids are the model's ids on both sides.

Checkpoints are read and written as full tensors in one process (``ptdp.checkpointing.full_model``), so
an export works from any (t, p, d, v) layout and an imported model trains in any layout. ``transformers``
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
from ptdp.hf import deepseek as hf_deepseek
from ptdp.hf import llama as hf_llama
from ptdp.hf import moe as hf_moe

if TYPE_CHECKING:  # torch loads only when a conversion runs, not for `ptdp --help`
    import torch

    from ptdp.data import Tokenizer
    from ptdp.models import GPTModel
TIED_EMBEDDING = "embedding.word_embeddings.weight"  # = ptdp.models.TIED_EMBEDDING

HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
HF_PREFIX = "transformer."
# HF activations that are exactly ptdp's GeLU with the tanh approximation.
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")

# ptdp name suffix inside layers.N -> (HF name suffix inside h.N, whether the weight is transposed)
_LAYER_MAP = {
    "input_layernorm.weight": ("ln_1.weight", False),
    "input_layernorm.bias": ("ln_1.bias", False),
    "attention.qkv.weight": ("attn.c_attn.weight", True),
    "attention.qkv.bias": ("attn.c_attn.bias", False),
    "attention.proj.weight": ("attn.c_proj.weight", True),
    "attention.proj.bias": ("attn.c_proj.bias", False),
    "post_attention_layernorm.weight": ("ln_2.weight", False),
    "post_attention_layernorm.bias": ("ln_2.bias", False),
    "mlp.fc1.weight": ("mlp.c_fc.weight", True),
    "mlp.fc1.bias": ("mlp.c_fc.bias", False),
    "mlp.fc2.weight": ("mlp.c_proj.weight", True),
    "mlp.fc2.bias": ("mlp.c_proj.bias", False),
}
_TOP_MAP = {
    "embedding.position_embeddings.weight": "wpe.weight",
    "final_layernorm.weight": "ln_f.weight",
    "final_layernorm.bias": "ln_f.bias",
}


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


def is_gpt2(cfg: ModelConfig) -> bool:
    """Whether ``cfg`` is the GPT-2 architecture HF's ``GPT2LMHeadModel`` computes."""
    return (cfg.position_embedding_type == "learned_absolute" and cfg.normalization == "LayerNorm"
            and not cfg.swiglu and not cfg.group_query_attention and cfg.tied_embeddings
            and not cfg.disable_bias_linear and not cfg.disable_bias_norm and cfg.head_dim * cfg.num_attention_heads == cfg.hidden_size)


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
    model.load_state_dict(tensors, strict=True)
    return model.eval()


# ---------------------------------------------------------------------------------------------- export

def to_hf_state(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """ptdp full tensors -> HF ``GPT2LMHeadModel`` tensors (``transformer.*``; ``lm_head`` is tied)."""
    import torch

    vocab, h = cfg.vocab_size, cfg.hidden_size
    out = {HF_PREFIX + "wte.weight": tensors[TIED_EMBEDDING][:vocab]}  # drop the padding rows
    for name, hf_name in _TOP_MAP.items():
        out[HF_PREFIX + hf_name] = tensors[name]
    for i in range(cfg.num_layers):
        for suffix, (hf_suffix, transpose) in _LAYER_MAP.items():
            value = tensors[f"layers.{i}.{suffix}"]
            if suffix.startswith("attention.qkv"):
                value = value.reshape(3 * h, h) if transpose else value.reshape(3 * h)
            out[f"{HF_PREFIX}h.{i}.{hf_suffix}"] = value.t() if transpose else value
    return {k: v.detach().to(torch.float32).contiguous() for k, v in out.items()}


def hf_config_dict(cfg: ModelConfig, eos_token_id: int | None) -> dict:
    """``GPT2Config`` keyword arguments that make HF compute exactly what ptdp computes."""
    return {
        "vocab_size": cfg.vocab_size, "n_positions": cfg.seq_length, "n_embd": cfg.hidden_size,
        "n_layer": cfg.num_layers, "n_head": cfg.num_attention_heads, "n_inner": cfg.ffn_size,
        "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_epsilon,
        "resid_pdrop": cfg.hidden_dropout, "embd_pdrop": cfg.hidden_dropout,
        "attn_pdrop": cfg.attention_dropout,
        "initializer_range": cfg.init_method_std, "tie_word_embeddings": True,
        "bos_token_id": eos_token_id, "eos_token_id": eos_token_id,
        "architectures": ["GPT2LMHeadModel"],
    }


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


def export_hf(load: str | Path, out: str | Path) -> Path:
    """Write ``OUT/config.json`` and ``OUT/model.safetensors`` from the newest checkpoint under ``load``."""
    from ptdp.checkpointing import read_full_model_state

    tensors, config_dict = read_full_model_state(load)
    transformers, safetensors_torch = _require_hf()
    cfg, moe = model_config_from_dict(config_dict), moe_config_from_dict(config_dict)
    kind = None if cfg.multi_latent_attention else hf_moe.hf_kind(cfg, moe)
    bos, eos = _special_ids(config_dict, cfg.vocab_size)
    if cfg.multi_latent_attention:  # issue 41: DeepSeek-V3
        state, hf_config = hf_deepseek.export(tensors, cfg, moe, bos, eos, f"--load {load}")
    elif moe.num_experts and kind is None:
        raise HFError(f"--load {load}: the mixture of experts is neither a Mixtral (Llama, every layer MoE, no "
                      "shared expert) nor a Qwen2-MoE (Llama with a gated shared expert); HF export supports those")
    elif kind is not None:
        state = hf_moe.to_hf_state(tensors, cfg, moe, kind)
        config_class = transformers.MixtralConfig if kind == "mixtral" else transformers.Qwen2MoeConfig
        hf_config = config_class(**hf_moe.hf_config_kwargs(cfg, moe, kind, bos, eos))
    elif hf_llama.is_llama(cfg):
        state = hf_llama.to_hf_state(tensors, cfg)
        hf_config = transformers.LlamaConfig(**hf_llama.hf_config_kwargs(cfg, bos, eos))
    elif is_gpt2(cfg):
        state = to_hf_state(tensors, cfg)
        hf_config = transformers.GPT2Config(**hf_config_dict(cfg, eos))
    else:
        raise HFError(f"--load {load}: the model is neither GPT-2 nor a Llama (rope + RMSNorm + SwiGLU, no "
                      "biases, --rotary-percent 1); Hugging Face export supports those two")
    (out := Path(out)).mkdir(parents=True, exist_ok=True)
    safetensors_torch.save_file(state, str(out / HF_WEIGHTS), metadata={"format": "pt"})
    hf_config.save_pretrained(str(out))
    return out


# ---------------------------------------------------------------------------------------------- import

def from_hf_state(hf_tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF GPT-2 tensors (with or without the ``transformer.`` prefix) -> ptdp full tensors, unpadded."""
    import torch

    hf = {k.removeprefix(HF_PREFIX): v for k, v in hf_tensors.items()}
    h = cfg.hidden_size

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise HFError(f"--in: the checkpoint has no tensor {HF_PREFIX}{name}; is it a GPT-2 model?")
        return hf[name]

    out = {TIED_EMBEDDING: take("wte.weight")}
    for name, hf_name in _TOP_MAP.items():
        out[name] = take(hf_name)
    for i in range(cfg.num_layers):
        for suffix, (hf_suffix, transpose) in _LAYER_MAP.items():
            value = take(f"h.{i}.{hf_suffix}")
            value = value.t() if transpose else value
            if suffix.startswith("attention.qkv"):
                value = value.reshape(3, h, h) if transpose else value.reshape(3, h)
            out[f"layers.{i}.{suffix}"] = value
    return {k: v.to(torch.float32).contiguous() for k, v in out.items()}


def model_config_from_hf(hf_config: dict) -> ModelConfig:
    """ptdp's model flags for an HF GPT-2 ``config.json``; refuses variants ptdp does not compute."""
    if hf_config.get("model_type") != "gpt2":
        raise HFError(f"--in: config.json has model_type {hf_config.get('model_type')!r}; "
                      "only 'gpt2', 'llama', 'mixtral', 'qwen2_moe' and 'deepseek_v3' models import")
    by_layer_idx = hf_config.get("scale_attn_by_inverse_layer_idx", False)
    checks = [
        ("activation_function", hf_config.get("activation_function", "gelu_new") in TANH_GELUS, "gelu_new"),
        ("scale_attn_weights", hf_config.get("scale_attn_weights", True), "true"),
        ("scale_attn_by_inverse_layer_idx", not by_layer_idx, "false"),
        ("add_cross_attention", not hf_config.get("add_cross_attention", False), "false"),
        ("tie_word_embeddings", hf_config.get("tie_word_embeddings", True), "true"),
    ]
    for key, ok, wanted in checks:
        if not ok:
            raise HFError(f"--in: config.json has {key}={hf_config.get(key)!r}; ptdp's GPT needs {wanted}")
    n_embd = hf_config["n_embd"]
    return ModelConfig(
        num_layers=hf_config["n_layer"], hidden_size=n_embd, num_attention_heads=hf_config["n_head"],
        ffn_hidden_size=hf_config.get("n_inner") or 4 * n_embd, seq_length=hf_config["n_positions"],
        hidden_dropout=hf_config.get("resid_pdrop", 0.1), attention_dropout=hf_config.get("attn_pdrop", 0.1),
        init_method_std=hf_config.get("initializer_range", 0.02),
        norm_epsilon=hf_config.get("layer_norm_epsilon", 1e-5), vocab_size=hf_config["vocab_size"],
    )


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
    moe = MoEConfig()
    if hf_config.get("model_type") == "deepseek_v3":  # issue 41
        cfg, moe, tensors = hf_deepseek.import_model(hf_config, read_hf_tensors(directory))
    elif hf_config.get("model_type") in ("mixtral", "qwen2_moe"):
        cfg, moe, kind = hf_moe.model_config_from_hf(hf_config)
        tensors = hf_moe.from_hf_state(read_hf_tensors(directory), cfg, moe, kind)
    elif hf_config.get("model_type") == "llama":
        cfg = hf_llama.model_config_from_hf(hf_config)
        tensors = hf_llama.from_hf_state(read_hf_tensors(directory), cfg)
    else:
        cfg = model_config_from_hf(hf_config)
        tensors = from_hf_state(read_hf_tensors(directory), cfg)
    path = write_full_model_state(save, tensors, {"model": dataclasses.asdict(cfg), "moe": dataclasses.asdict(moe)})
    return path, cfg, moe


# Fields that decide what the imported model computes: ``ptdp train --load`` must be given the same.
_MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length", "norm_epsilon",
                "position_embedding_type", "rotary_base", "use_rope_scaling", "rope_scaling_factor", "normalization",
                "swiglu", "group_query_attention", "num_query_groups", "untie_embeddings_and_output_weights",
                "disable_bias_linear", "kv_channels", "add_qkv_bias", *hf_deepseek.MODEL_FLAGS)


def train_flags(cfg: ModelConfig, moe: MoEConfig | None = None) -> str:
    """The ``ptdp train`` flags that load an imported model (its shape flags, the Llama options if any, the
    mixture of experts if any)."""
    default = ModelConfig()
    given, defaults = {**dataclasses.asdict(cfg), "ffn_hidden_size": cfg.ffn_size}, dataclasses.asdict(default)
    flags = []
    for name in _MODEL_FLAGS:
        value = given[name]
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags += [flag] if value else []
        elif value is not None and (name in _MODEL_FLAGS[:6] or value != defaults[name]):
            flags.append(f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}")
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
    parser.add_argument("--format", default="hf", choices=["hf"],
                        help="output format (Hugging Face GPT-2, Llama, Mixtral, Qwen2-MoE or DeepSeek-V3)")
    parser.add_argument("--out", required=True,
                        help="directory to write config.json and model.safetensors to")


def add_import_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", default="hf", choices=["hf"],
                        help="input format (Hugging Face: model_type gpt2, llama, mixtral, qwen2_moe or deepseek_v3)")
    parser.add_argument("--in", dest="input", required=True,
                        help="directory with config.json and model.safetensors (save_pretrained)")
    parser.add_argument("--save", required=True, help="checkpoint directory to write (load it with --load)")


def run_export(args: argparse.Namespace) -> int:
    from ptdp.checkpointing import CheckpointError

    try:
        out = export_hf(args.load, args.out)
    except CheckpointError as e:
        return _fail("export", f"--load {args.load}: {e}")
    except ConfigError as e:
        return _fail("export", str(e))
    print(f"wrote {out}/config.json and {out}/{HF_WEIGHTS}: AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


def run_import(args: argparse.Namespace) -> int:
    try:
        path, cfg, moe = import_hf_model(args.input, args.save)
    except (ConfigError, KeyError) as e:
        return _fail("import", str(e) if isinstance(e, ConfigError) else f"--in: config.json lacks {e}")
    except ValueError as e:  # shapes that contradict config.json
        return _fail("import", f"--in {args.input}: {e}")
    print(f"wrote {path}; continue training with: ptdp train --load {args.save} {train_flags(cfg, moe)}")
    return 0


def _fail(command: str, message: str) -> int:
    from ptdp.runtime.errors import error_line

    sys.stderr.write(error_line(command, message))
    return 2
