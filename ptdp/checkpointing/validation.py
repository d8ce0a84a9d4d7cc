"""Start-up checks of the checkpoint flags: run at start-up (``ptdp.cli.main.start_problems``) in the launcher
and on every rank, before any process group exists, so a bad ``--save``/``--load`` or a corrupted checkpoint stops every
rank with the same one-line message and none waits for another. No torch import here.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ptdp.checkpointing.storage import (
    LATEST,
    VERIFIED_ENV,
    CheckpointError,
    continues,
    read_info,
    read_latest,
    resolve,
    saved_iterations,
    verified_token,
    verify_checksums,
)
from ptdp.config import Config, ModelConfig
from ptdp.config.optimizers import canonical_name

# Flags that change a parameter's logical shape: a checkpoint only loads into the same values.
SHAPE_FLAGS = {"num_layers": "--num-layers", "hidden_size": "--hidden-size",
               "num_attention_heads": "--num-attention-heads", "ffn_size": "--ffn-hidden-size"}


# Architecture flags (the Llama options): another value means other parameters or another computation.
ARCHITECTURE_FLAGS = {"position_embedding_type": "--position-embedding-type", "normalization": "--normalization",
                      "swiglu": "--swiglu", "group_query_attention": "--group-query-attention",
                      "num_query_groups": "--num-query-groups", "kv_channels": "--kv-channels",
                      "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
                      "disable_bias_linear": "--disable-bias-linear", "disable_bias_norm": "--disable-bias-norm",
                      "qk_layernorm": "--qk-layernorm", "window_size": "--window-size",
                      "window_attn_skip_freq": "--window-attn-skip-freq", "local_rotary_base": "--local-rotary-base",
                      "sandwich_norm": "--sandwich-norm", "apply_layernorm_1p": "--apply-layernorm-1p",
                      "scale_embedding": "--scale-embedding", "geglu": "--geglu", "softmax_scale": "--softmax-scale",
                      "softmax_type": "--softmax-type", "quick_geglu": "--quick-geglu",
                      "glu_linear_offset": "--glu-linear-offset",
                      "activation_func_clamp_value": "--activation-func-clamp-value",
                      "attention_output_gate": "--attention-output-gate",
                      "experimental_attention_variant": "--experimental-attention-variant",
                      "linear_attention_freq": "--linear-attention-freq",
                      "linear_conv_kernel_dim": "--linear-conv-kernel-dim", "linear_key_head_dim": "--linear-key-head-dim",
                      "linear_value_head_dim": "--linear-value-head-dim",
                      "linear_num_key_heads": "--linear-num-key-heads",
                      "linear_num_value_heads": "--linear-num-value-heads"}


def _fields(model: ModelConfig) -> dict:
    """The model's fields and its derived ffn size, under the keys ``ptdp.json`` records them by."""
    return {**dataclasses.asdict(model), "ffn_size": model.ffn_size}


def model_shape(model: ModelConfig, vocab_size: int, padded_vocab_size: int) -> dict:
    """What ``ptdp.json`` records about the model: the config plus the values derived from it."""
    return {**_fields(model), "vocab_size": vocab_size, "padded_vocab_size": padded_vocab_size}


def _saved_gelu(saved: dict) -> str:
    """The GeLU form (``ModelConfig.gelu_approximate``) of a checkpoint's plain GeLU MLP; before
    ``--no-bias-gelu-fusion`` and ``--openai-gelu`` existed, ptdp's GeLU was always the tanh one."""
    if "bias_gelu_fusion" not in saved:
        return "tanh"
    fused = saved["bias_gelu_fusion"] and not saved.get("disable_bias_linear")
    return "tanh" if saved.get("openai_gelu") or fused else "none"


def model_mismatch(saved: dict, model: ModelConfig, vocab_size: int | None, tp: int) -> str | None:
    """One line naming every shape flag whose value differs from the checkpoint's, or None."""
    here, default = _fields(model), _fields(ModelConfig())  # checkpoints from before the Llama options: defaults
    diffs = [f"{flag} {saved.get(key)} there, {here[key]} here"
             for key, flag in SHAPE_FLAGS.items() if saved.get(key) != here[key]
             # a default ffn size (4h) follows --hidden-size: name only the flag the user changed
             and not (key == "ffn_size" and model.ffn_hidden_size is None and saved.get("ffn_hidden_size") is None
                      and saved.get("hidden_size") != model.hidden_size)]
    diffs += [f"{flag} {saved.get(key, default[key])} there, {here[key]} here"
              for key, flag in ARCHITECTURE_FLAGS.items()
              if saved.get(key, default[key]) != here[key]
              and (key != "num_query_groups" or model.group_query_attention)
              and (key != "disable_bias_norm" or model.normalization != "RMSNorm")]  # RMSNorm has no bias
    gelu = _saved_gelu(saved)
    if not model.gated_mlp and not diffs and gelu != model.gelu_approximate:
        name = {"tanh": "tanh", "none": "exact"}
        diffs.append(f"the GeLU {name[gelu]} there, {name[model.gelu_approximate]} here (--openai-gelu, "
                     "--no-bias-gelu-fusion, --disable-bias-linear: docs/cli.md#gelu)")
    # --seq-length is a training setting (any length up to the positions the model was built for); a learned
    # position table's rows are a shape (checkpoints from before --max-position-embeddings: their --seq-length)
    rows, here_rows = saved.get("max_position_embeddings") or saved.get("seq_length"), (model.max_position_embeddings
                                                                                      or model.seq_length)
    if model.position_embedding_type == "learned_absolute" and rows != here_rows:
        neither = saved.get("max_position_embeddings") is None and model.max_position_embeddings is None
        flag = "--seq-length" if neither else "--max-position-embeddings"  # the flag that sized each table
        diffs.append(f"{flag} {rows} there, {here_rows} here")
    if vocab_size is not None and vocab_size != saved.get("vocab_size"):
        diffs.append(f"--vocab-size {saved.get('vocab_size')} there, {vocab_size} here")
    if diffs:
        return "the checkpoint holds another model: " + "; ".join(diffs) + "; pass the checkpoint's values"
    padded = model.padded_vocab_size(saved["vocab_size"], tp)
    if padded != saved.get("padded_vocab_size"):
        return (f"the checkpoint's vocabulary is padded to {saved.get('padded_vocab_size')} rows but "
                f"--make-vocab-size-divisible-by {model.make_vocab_size_divisible_by} with "
                f"--tensor-model-parallel-size {tp} pads it to {padded}; choose values that give "
                f"{saved.get('padded_vocab_size')}")
    return None


def optimizer_mismatch(info: dict, config: Config) -> str | None:
    """One line when the checkpoint's optimizer state is another ``--optimizer``'s (AdamW's moments do not
    become Muon's momentum, nor the reverse), unless ``--no-load-optim`` leaves it unread."""
    lora = info.get("config", {}).get("lora", {})
    saved_lora = (lora.get("lora_rank", 0), sorted(lora.get("lora_target_modules", [])) if lora.get("lora_rank") else [])
    this_lora = (config.lora.lora_rank, sorted(config.lora.lora_target_modules) if config.lora.lora_rank else [])
    if saved_lora != this_lora:  # other adapters (or none): another set of trained parameters
        return (f"the checkpoint was trained with --lora-rank {saved_lora[0]}"
                + (f" on {' '.join(saved_lora[1])}" if saved_lora[0] else "")
                + f", this run uses --lora-rank {this_lora[0]}" + (f" on {' '.join(this_lora[1])}" if this_lora[0] else "")
                + "; resume with the same LoRA flags (--pretrained-checkpoint starts a new run from its weights, "
                "reading the adapters this run has)")
    saved = info.get("config", {}).get("optimizer", {}).get("optimizer", "adam")  # before --optimizer: AdamW
    saved = canonical_name(saved)  # an alias (dist_muon) saved is its optimizer's state
    if "optimizer" not in info.get("contents", []) or config.checkpoint.no_load_optim or saved == config.optimizer.kind:
        return None
    return (f"the checkpoint holds --optimizer {saved}'s state, this run uses --optimizer {config.optimizer.optimizer}; "
            "pass --no-load-optim to load the model and start the optimizer afresh")


def checkpoint_errors(config: Config, world_size: int, hash_data: bool | None = None) -> list[str]:
    """Every problem with the checkpoint flags, one line each (empty when there is nothing to check).
    ``hash_data``: hash the checkpoint's data files too (default: in one process only; a launcher on one
    node does, so that no worker starts on a corrupted checkpoint)."""
    ck = config.checkpoint
    errors = []
    for flag, value in (("--save-interval", ck.save_interval), ("--exit-interval", ck.exit_interval),
                        ("--keep-last", ck.keep_last)):
        if value is not None and value <= 0:
            errors.append(f"{flag} must be a positive integer, got {value}")
    for flag, value in (("--save-interval", ck.save_interval), ("--keep-last", ck.keep_last)):
        if value is not None and not ck.save:
            errors.append(f"{flag} needs --save DIR, the directory to write checkpoints to")
    if errors:
        return errors
    if ck.save:
        errors += _save_errors(Path(ck.save))
    if ck.save and not errors:
        errors += other_run_errors(ck.save, ck.load)
    if ck.load and not errors:
        errors += _load_errors(config, Path(ck.load), world_size == 1 if hash_data is None else hash_data)
    if ck.pretrained_checkpoint and not errors:
        errors += _pretrained_errors(config, Path(ck.pretrained_checkpoint))
    return errors


def _pretrained_errors(config: Config, path: Path) -> list[str]:
    """``--pretrained-checkpoint``: a checkpoint of the same model (its weights only are read)."""
    try:
        directory = resolve(path) if path.is_dir() else None
        if directory is None:
            return [f"--pretrained-checkpoint {path} holds no checkpoint; give a directory written by --save or "
                    "`ptdp import`"]
        verify_checksums(directory, hash_data=False)
        info = read_info(directory)
    except CheckpointError as e:
        return [f"--pretrained-checkpoint {path}: {e}"]
    from ptdp.data.training_data import model_vocab_size

    problem = model_mismatch(info["model"], config.model, model_vocab_size(config),
                             config.parallel.tensor_model_parallel_size)
    return [f"--pretrained-checkpoint {directory}: {problem}"] if problem else []


def share_verification(load: str | Path) -> None:
    """Tell the workers (through the environment they inherit) that the launcher hashed ``--load``'s
    checkpoint whole (:func:`checkpoint_errors` with ``hash_data``), so they do not hash it again."""
    try:
        directory = resolve(Path(load))
    except CheckpointError:
        return
    token = verified_token(directory) if directory is not None else None
    if token:
        os.environ[VERIFIED_ENV] = token


def _save_errors(path: Path) -> list[str]:
    """Create the directory and write a probe file: the only reliable test (root ignores permissions)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except (FileExistsError, NotADirectoryError):
        return [f"--save {path} is not a directory (a file is in the way); choose a directory path"]
    except OSError as e:
        return [f"--save {path} is not writable ({e.strerror}); choose a directory you can write to"]
    return []


def other_run_errors(save: str, load: str | None) -> list[str]:
    """``--save DIR`` where DIR holds checkpoints (``latest`` or ``iter_*`` directories) that ``--load`` does
    not continue (no ``--load``, or one elsewhere): the run would train from another start, move ``latest``
    back and let ``--keep-last`` delete that run's checkpoints, so it stops instead. ``--load DIR`` (or one
    of DIR's ``iter_*`` directories) continues the run in DIR and passes. A worker restarted by its launcher
    (``TORCHELASTIC_RESTART_COUNT`` above 0) skips the check: its job's first attempt passed it and wrote
    what DIR holds now."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return []
    try:
        if load and continues(load, save):
            return []
    except CheckpointError:  # --load's own problem: the --load checks name it
        return []
    root = Path(save)
    iterations = saved_iterations(root)
    if not iterations and not (root / LATEST).exists():
        return []  # nothing saved there yet (a leftover of a save cut short is removed at start-up)
    try:
        latest = read_latest(root)
    except CheckpointError:
        latest = None
    held = f"latest iteration {latest}" if latest is not None else f"{len(iterations)} iter_* directories"
    started = f"--load {load} starts elsewhere" if load else "no --load is given"
    return [f"--save {save} already holds another run's checkpoints ({held}) and {started}: saving there would "
            f"overwrite them and move {root / LATEST} back; pass --load {save} to continue that run, "
            "or --save a fresh directory"]


MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's counterpart of `latest`


def _missing(config: Config, path: Path) -> list[str]:
    """No checkpoint in ``--load DIR``: fine (the run starts from scratch and says so), unless
    ``--exit-on-missing-checkpoint`` (Megatron-LM's flag) makes it an error."""
    if config.checkpoint.exit_on_missing_checkpoint:
        return [f"--load {path} holds no checkpoint and --exit-on-missing-checkpoint is set; point --load at a "
                "directory written by --save, or drop --exit-on-missing-checkpoint to start from scratch"]
    return []


def hf_load_errors(config: Config, path: Path) -> list[str]:
    """The start-up checks of ``--load HF_DIR`` (``hf_dir``): the files, the family, and the run's model flags
    against config.json's (the flags ``ptdp import`` prints: nothing is inferred, so a run's flags say what
    it trains)."""
    from ptdp.checkpointing import hf_dir
    from ptdp.data.training_data import model_vocab_size

    tp = config.parallel.tensor_model_parallel_size
    try:
        source = hf_dir.open_hf_dir(path)
        vocab = source.cfg.vocab_size
        padded = config.model.padded_vocab_size(vocab, tp)
        hf_dir.check_recipes(source, padded)
    except CheckpointError as e:
        return [f"--load {e}" if str(e).startswith(str(path)) else f"--load {path}: {e}"]
    problem = (model_mismatch(model_shape(source.cfg, vocab, padded), config.model, model_vocab_size(config), tp)
               or hf_dir.moe_mismatch(source, config.moe))
    if problem:
        return [f"--load {path}: {problem} (`ptdp import --format hf --in {path}` prints them)"]
    return []


def _load_errors(config: Config, path: Path, hash_data: bool = True) -> list[str]:
    ck = config.checkpoint
    from ptdp.checkpointing.hf_dir import is_hf_dir

    if is_hf_dir(path):
        return hf_load_errors(config, path)
    if (path / MEGATRON_TRACKER).is_file() and not (path / "latest").exists():
        return [f"--load {path} is a Megatron-LM checkpoint ({MEGATRON_TRACKER}), which ptdp does not train from "
                f"directly; convert it with `ptdp import --format megatron --in {path} --save DIR` (it prints the "
                "flags that continue the run) and --load DIR"]
    if not path.exists():
        if ck.save and Path(ck.save).resolve() == path.resolve():
            return _missing(config, path)  # `--save DIR --load DIR` before the first save: start fresh
        return [f"--load {path} does not exist; give a directory written by --save (or the --save directory "
                "itself, to resume a run that may not have saved yet)"]
    if not path.is_dir():
        return [f"--load {path} is not a directory; give a directory written by --save"]
    try:
        directory = resolve(path)
        if directory is None:
            return _missing(config, path)  # no `latest` yet: nothing was saved, start fresh
        # One process hashes everything; the ranks of a job hash the data files in shares after start-up
        # (saver.verify_data_files) instead of every rank reading every file.
        verify_checksums(directory, hash_data=hash_data)
        info = read_info(directory)
    except CheckpointError as e:
        return [str(e)]
    from ptdp.data.training_data import model_vocab_size

    problem = model_mismatch(info["model"], config.model, model_vocab_size(config),
                             config.parallel.tensor_model_parallel_size) or optimizer_mismatch(info, config)
    if problem:
        return [f"--load {directory}: {problem}"]
    # a dataset changed under its prefix: exit 2 before any worker starts
    from ptdp.data.mix_state import data_state_errors
    from ptdp.data.training_data import train_data

    return data_state_errors(train_data(config)[0], config.data.override_data_state, info, str(directory))
