"""``ptdp import --format megatron`` / ``ptdp export --format megatron``, and the dispatch of both commands by
``--format`` (Hugging Face's in ``ptdp.hf.convert``).

Import reads the newest Megatron-LM save whole and checks it (the args ptdp computes, every tensor present
and placed) before writing anything; the ptdp checkpoint it writes stands at the Megatron run's iteration
and consumed samples, so ``ptdp train --load`` with the printed flags continues Megatron's sample order from
the next sample. The distributed optimizer's state (Adam's moments and step count, ``ptdp.megatron.optim``)
is carried, with the LR schedule's flags, from the formats ptdp maps onto parameters (per parameter, or
laid out by Megatron's gradient buckets, ``ptdp.megatron.buckets``); ``--no-load-optim``
leaves it out (and imports a save whose optimizer state ptdp cannot read).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from ptdp.config import ConfigError, ModelConfig, MoEConfig
from ptdp.hf import convert
from ptdp.megatron.args import MegatronError, model_from_args

# Megatron-LM args -> (ptdp config section, field): the run's position in its data, recorded and printed
_RUN_ARGS = {"global_batch_size": ("training", "global_batch_size"), "micro_batch_size": ("training", "micro_batch_size"),
             "train_iters": ("training", "train_iters"), "seed": ("training", "seed"),
             "eval_interval": ("training", "eval_interval"), "eval_iters": ("training", "eval_iters"),
             "data_path": ("data", "data_path"), "split": ("data", "split"),
             # with the optimizer's state: the AdamW and LR-schedule flags it goes on with (ptdp.megatron.optim)
             **{name: ("optimizer", name) for name in ("lr", "min_lr", "lr_decay_style", "lr_warmup_iters",
                                                       "lr_decay_iters", "weight_decay", "adam_beta1", "adam_beta2",
                                                       "adam_eps", "clip_grad")}}


@dataclasses.dataclass(frozen=True)
class Imported:
    """What ``ptdp import --format megatron`` wrote and what continues it."""

    path: Path
    model: ModelConfig
    moe: MoEConfig
    iteration: int
    consumed_samples: int
    run: dict  # the Megatron run's flags ptdp shares (batch sizes, iterations, seed, data)


def import_megatron(directory: str | Path, save: str | Path, no_load_optim: bool = False) -> Imported:
    """Write the newest Megatron-LM save under ``directory`` as a ptdp checkpoint under ``save``."""
    from ptdp.checkpointing import write_full_model_state
    from ptdp.megatron.names import to_ptdp
    from ptdp.megatron.read import read_checkpoint

    ckpt = read_checkpoint(directory, read_optimizer=not no_load_optim)
    cfg, moe = model_from_args(ckpt.args)
    run = {key: ckpt.args[key] for key, (section, _) in _RUN_ARGS.items()
           if ckpt.args.get(key) is not None and section != "optimizer"}
    batch = run.get("global_batch_size")
    consumed = int(ckpt.args.get("consumed_train_samples") or 0)
    if batch and consumed != ckpt.iteration * batch:
        raise MegatronError(f"--in {ckpt.directory}: consumed_train_samples {consumed} is not iteration "
                            f"{ckpt.iteration} x global_batch_size {batch} (a rampup_batch_size run); ptdp continues "
                            "runs of one global batch size")
    optimizer = None
    if ckpt.has_optimizer and not no_load_optim:
        from ptdp.megatron.optim import check_optimizer_args, optimizer_to_ptdp

        run.update(check_optimizer_args(ckpt, consumed))
        optimizer = optimizer_to_ptdp(ckpt, cfg, moe, cfg.padded_vocab_size(cfg.vocab_size, 1))
    tensors = to_ptdp(ckpt.tensors, cfg, moe)
    padded = cfg.padded_vocab_size(cfg.vocab_size, 1)
    for name in ("embedding.word_embeddings.weight", "lm_head.weight"):  # Megatron padded for its t: rows
        if name in tensors and tensors[name].shape[0] > padded:  # past ptdp's padding are never a token
            tensors[name] = tensors[name][:padded]
    sections: dict[str, dict] = {"model": dataclasses.asdict(cfg), "moe": dataclasses.asdict(moe)}
    for key, value in run.items():
        section, name = _RUN_ARGS[key]
        sections.setdefault(section, {})[name] = value
    try:
        path = write_full_model_state(save, tensors, sections, iteration=ckpt.iteration, consumed_samples=consumed,
                                      optimizer=optimizer)
    except ValueError as e:  # a tensor the args do not account for, or a shape that contradicts them
        raise MegatronError(f"--in {ckpt.directory}: {str(e).removeprefix('write_full_model_state: ')} "
                            "(the tensors contradict the checkpoint's args)") from None
    return Imported(path, cfg, moe, ckpt.iteration, consumed, run)


def continue_flags(imported: Imported) -> str:
    """The ``ptdp train`` flags that continue the imported run: the model, the vocabulary, its batch sizes,
    iterations, seed and data (what fixes the sample order)."""
    flags = [convert.train_flags(imported.model, imported.moe), f"--vocab-size {imported.model.vocab_size}"]
    default = ModelConfig()
    if imported.model.seq_length != default.seq_length and "--seq-length" not in flags[0]:
        flags.append(f"--seq-length {imported.model.seq_length}")
    for name in ("hidden_dropout", "attention_dropout"):  # Megatron's run went on with these
        if getattr(imported.model, name) != getattr(default, name):
            flags.append(f"--{name.replace('_', '-')} {getattr(imported.model, name):g}")
    for key, value in imported.run.items():
        flag = "--" + key.replace("_", "-")
        flags.append(f"{flag} {' '.join(map(str, value))}" if isinstance(value, list) else f"{flag} {value}")
    return " ".join(flags)


# ---------------------------------------------------------------------------------------------- CLI

def add_import_arguments(parser: argparse.ArgumentParser) -> None:
    convert.add_import_arguments(parser)
    parser.add_argument("--no-load-optim", action="store_true",
                        help="--format megatron: leave the distributed optimizer's state out (the optimizer starts "
                             "afresh); needed for a save whose optimizer state ptdp cannot read")


def run_import(args: argparse.Namespace) -> int:
    if args.format != "megatron":
        return convert.run_import(args)
    try:
        imported = import_megatron(args.input, args.save, args.no_load_optim)
    except ConfigError as e:
        return convert._fail("import", str(e))
    except Exception as e:
        from ptdp.checkpointing import CheckpointError

        if isinstance(e, CheckpointError):
            return convert._fail("import", f"--save {args.save}: {e}")
        raise
    print(f"wrote {imported.path} (Megatron-LM iteration {imported.iteration}, {imported.consumed_samples} samples "
          f"consumed); continue training with: ptdp train --load {args.save} {continue_flags(imported)}")
    return 0


def run_export(args: argparse.Namespace) -> int:
    if args.format != "megatron":
        return convert.run_export(args)
    from ptdp.checkpointing import CheckpointError
    from ptdp.megatron.write import export_megatron

    try:
        directory = export_megatron(args.load, args.out)
    except CheckpointError as e:
        return convert._fail("export", f"--load {args.load}: {e}")
    except ConfigError as e:
        return convert._fail("export", str(e))
    print(f"wrote {directory} (torch_dist): load it in Megatron-LM with --load {args.out} --finetune "
          "--use-checkpoint-args")
    return 0
