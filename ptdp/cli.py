"""``ptdp`` command line: train, plan, simulate, preprocess, generate, export, import, timeline."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .config import ConfigError, add_config_arguments, config_from_args, validate
from .errors import print_error


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a GPT with PTD-P (under torchrun, or launching workers itself)")
    add_config_arguments(p)
    launch = p.add_argument_group("launch")
    launch.add_argument("--nproc-per-node", type=int, default=None,
                        help="start this many local workers through torch.distributed.run")
    launch.add_argument("--max-restarts", type=int, default=0,
                        help="restart all workers up to K times when one fails (torchrun's elastic restart)")
    p.set_defaults(run=run_train)


def run_train(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as e:
        return _fail(str(e))
    launching = args.nproc_per_node is not None and "LOCAL_RANK" not in os.environ
    world_size = args.nproc_per_node if launching else int(os.environ.get("WORLD_SIZE", "1"))
    local_world_size = args.nproc_per_node if launching else int(
        os.environ.get("LOCAL_WORLD_SIZE", world_size))
    errors = validate(config, world_size, local_world_size)
    if not errors:  # --save/--load and the checkpoint itself (checksums, model shape); not in ptdp.config,
        from .checkpointing.validation import checkpoint_errors  # which must not import checkpointing

        errors = checkpoint_errors(config, world_size)
    if errors:
        # Every rank rejects the configuration before any collective; only rank 0 speaks.
        if int(os.environ.get("RANK", "0")) == 0:
            for line in errors:
                print_error("train", line)
        return 2
    if launching:
        from .launch import launch_workers

        return launch_workers(args.nproc_per_node, args.max_restarts, _worker_argv(sys.argv))

    from .data import DataError
    from .training import train

    try:
        train(config)
        code = 0
    except (ConfigError, DataError) as e:  # raised alike on every rank: the groups are still healthy
        code = _fail(str(e))
    # gloo aborts the process at exit ("terminate called without an active exception") when its process
    # groups are left for the interpreter to tear down. Not after other errors: a lost peer can make the
    # teardown wait, and the launcher restarts or stops the job anyway.
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return code


def _worker_argv(argv: list[str]) -> list[str]:
    """The command line each worker runs: ours without the launcher's own flags."""
    out, skip = [], False
    for arg in argv[1:]:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in ("--nproc-per-node", "--max-restarts"):
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def _fail(message: str) -> int:
    if int(os.environ.get("RANK", "0")) == 0:
        print_error(None, message)
    return 2


# Sub-commands besides train: (name, module, its add-arguments function, its run function, help).
_COMMANDS = [
    ("plan", ".planner", "add_plan_arguments", "run_plan", "choose (t, p, d, b, v) for a model on a cluster"),
    ("simulate", ".simulate", "add_simulate_arguments", "run_simulate",
     "simulate a pipeline schedule and draw its timeline"),
    ("preprocess", ".data.preprocess", "add_preprocess_arguments", "run_preprocess",
     "tokenize JSONL into indexed .bin/.idx files"),
    ("generate", ".generate", "add_generate_arguments", "run_generate",
     "continue a prompt with a checkpoint (any layout, one process)"),
    ("export", ".hf", "add_export_arguments", "run_export",
     "write a checkpoint (any layout) as a Hugging Face GPT-2 model"),
    ("import", ".hf", "add_import_arguments", "run_import", "write a Hugging Face GPT-2 model as a ptdp checkpoint"),
    ("timeline", ".observability.timeline", "add_timeline_arguments", "run_timeline",
     "merge the per-rank Chrome traces of a --timeline run"),
]


def _other_parsers(sub) -> None:
    for name, module_name, add_arguments, run, help_text in _COMMANDS:
        module = importlib.import_module(module_name, __package__)
        p = sub.add_parser(name, help=help_text)
        getattr(module, add_arguments)(p)
        p.set_defaults(run=getattr(module, run))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ptdp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _other_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
