"""ptdp command line: train, plan, simulate, preprocess, samples, generate, export, import, timeline."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ptdp.config import Config, ConfigError, add_config_arguments, config_from_args, derive, validate
from ptdp.runtime import collector
from ptdp.runtime.errors import print_error
from ptdp.runtime.exit import exit_now


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a GPT, Llama or MoE model with PTD-P (under torchrun, or launching workers itself)")
    add_config_arguments(p)
    launch = p.add_argument_group("launch")
    launch.add_argument("--nproc-per-node", type=int, default=None,
                        help="start this many local workers through torch.distributed.run")
    launch.add_argument("--max-restarts", type=int, default=None,
                        help="restart all workers up to K times when one fails (torchrun's elastic restart; "
                        "default 0, or 3 with --elastic / --nnodes MIN:MAX)")
    launch.add_argument("--nnodes", default=None,
                        help="nodes, N or MIN:MAX (torchrun's elastic agent: the job goes on with any number of "
                        "agents in the range, d follows the world size); needs --rdzv-endpoint when MAX > 1")
    launch.add_argument("--elastic", action="store_true",
                        help="the world size may differ from the checkpoint's (one node: --nproc-per-node may "
                        "change between relaunches): d follows it, t, p and the global batch are kept")
    launch.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT where the agents of a multi-node "
                        "job meet (torchrun's c10d rendezvous)")
    launch.add_argument("--rdzv-id", default=None, help="the job's rendezvous id, the same on every agent")
    launch.add_argument("--rdzv-conf", default=None, help="torchrun's rendezvous options, e.g. "
                        "last_call_timeout=5,join_timeout=600,keep_alive_interval=5")
    launch.add_argument("--monitor-interval", type=float, default=None,
                        help="seconds between the agent's checks of its workers (torchrun's flag)")
    launch.add_argument("--cpu-mmap-threshold", type=_bytes, default=1 << 20, metavar="BYTES",
                        help="CPU workers: glibc's malloc serves allocations of at least BYTES by mmap and returns "
                        "them when freed, so the resident set follows what training holds (BENCHMARKS.md, CPU "
                        "allocator); 0 keeps glibc's dynamic threshold. Ignored on GPUs and if "
                        "MALLOC_MMAP_THRESHOLD_ is set")
    p.set_defaults(run=run_train)


def _bytes(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a number of bytes >= 0, got {text!r}")
    return int(text)


# The launcher's flags, which the workers do not get (each takes a value).
_LAUNCHER_FLAGS = ("--nproc-per-node", "--max-restarts", "--nnodes", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf",
                   "--monitor-interval", "--cpu-mmap-threshold")


def run_train(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as e:  # every problem of the TOML file, one line each
        for line in e.problems:
            _fail(line, "train")
        return 2
    from ptdp.runtime import interrupt

    interrupt.know_save(config.checkpoint.save)  # what a Ctrl-C from now on says about the checkpoints
    launching = args.nproc_per_node is not None and "LOCAL_RANK" not in os.environ
    world_size = args.nproc_per_node if launching else int(os.environ.get("WORLD_SIZE", "1"))
    local_world_size = args.nproc_per_node if launching else int(
        os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if launching or "LOCAL_RANK" not in os.environ:  # at once: the checks import torch, which can take seconds
        from ptdp.runtime.launch import launch_line

        par = config.parallel
        print(launch_line(args.nproc_per_node if launching else None, world_size, par.tensor_model_parallel_size,
                          par.context_parallel_size, par.pipeline_model_parallel_size), flush=True)
    replicas = config.parallel.fault_tolerant_replicas
    from ptdp.runtime.replicas import GROUP_ENV, LIGHTHOUSE_ENV

    replica_launcher = launching and replicas > 1 and GROUP_ENV not in os.environ
    if replica_launcher:  # validated as one group: the R groups are R jobs of N/R workers
        if args.nproc_per_node % replicas:
            return _fail(f"--nproc-per-node {args.nproc_per_node} is not divisible by --fault-tolerant-replicas "
                         f"{replicas}", "train")
        world_size, local_world_size = world_size // replicas, local_world_size // replicas
    elif replicas > 1 and not launching and not {GROUP_ENV, LIGHTHOUSE_ENV} <= set(os.environ):
        return _fail(f"--fault-tolerant-replicas {replicas} without ptdp's launcher needs {GROUP_ENV} (this "
                     f"group's index) and {LIGHTHOUSE_ENV} (the lighthouse's address) set: docs/multinode.md",
                     "train")
    if replicas > 1:
        from ptdp.runtime.replicas import torchft_problem

        problem = torchft_problem()
        if problem:
            return _fail(problem, "train")
    from ptdp.runtime.elastic import parse_nnodes, world_size_error

    try:
        nodes = parse_nnodes(args.nnodes)
    except ValueError as e:
        return _fail(str(e), "train")
    elastic = args.elastic or nodes[0] != nodes[1]
    if launching and nodes[1] > 1 and not args.rdzv_endpoint:
        return _fail(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, where the agents meet", "train")
    if launching and nodes[1] > 1:  # the workers check the world size they get; here: can any work?
        world_size = next((n * args.nproc_per_node for n in range(nodes[0], nodes[1] + 1)
                           if not validate(config, n * args.nproc_per_node, local_world_size)),
                          nodes[0] * args.nproc_per_node)
    if elastic:  # one line naming the world sizes that would work, instead of what this one breaks
        line = world_size_error(config, world_size, local_world_size, nodes=local_world_size != world_size
                                or nodes[1] > 1)
        if line:
            return _fail(line, "train")
    errors = validate(config, world_size, local_world_size)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if not errors:  # the machine (FP8 GPU), the directories and the files (data, tokenizer, checkpoint)
        from ptdp.runtime.phases import phase
        from ptdp.runtime.startup import startup_warnings

        given, config = config, derive(config)  # validate never changes what it checks
        with phase("importing torch"):
            import torch  # noqa: F401 - the checks below need it; say so when it takes a while
        with phase("checking the input files and the machine"):
            errors = start_problems(config, world_size, launcher=launching, one_node=nodes[1] == 1)
        for line in startup_warnings(given, config) if rank0 and not launching else ():
            print(f"warning: {line}", file=sys.stderr)
    if errors:
        # Every rank rejects the configuration before any collective; only rank 0 speaks.
        if rank0:
            for line in errors:
                print_error("train", line)
        return 2
    if replica_launcher or launching:  # this process launches and waits; its imports are done
        collector.resume()
    if replica_launcher:
        from ptdp.runtime.replicas import launch_replica_groups

        return launch_replica_groups(sys.argv[1:], args.nproc_per_node, replicas, config.checkpoint.save,
                                     config.training.metrics_file, config.checkpoint.load)
    if launching:
        from ptdp.runtime.launch import launch_workers

        rendezvous = None
        if args.nnodes is not None or args.rdzv_endpoint:
            rendezvous = {"nnodes": args.nnodes or "1", "rdzv_endpoint": args.rdzv_endpoint, "rdzv_id": args.rdzv_id,
                          "rdzv_conf": args.rdzv_conf, "monitor_interval": args.monitor_interval}
        restarts = args.max_restarts if args.max_restarts is not None else (3 if elastic or replicas > 1 else 0)
        worker_args = _worker_argv(sys.argv) + (["--elastic"] if elastic and not args.elastic else [])
        from ptdp.observability.flight_recorder import run_directory

        return launch_workers(args.nproc_per_node, restarts, worker_args, rendezvous, save=config.checkpoint.save,
                              cpu_mmap_threshold=args.cpu_mmap_threshold,
                              run_dir=run_directory(config.checkpoint.save, config.training.metrics_file))

    from ptdp.cli.worker import run_worker

    return run_worker(config)


def start_problems(config: Config, world_size: int, launcher: bool = False, one_node: bool = True) -> list[str]:
    """Every reason the derived ``config`` cannot start here, one line each (none: it can): the start-up
    checks of the features that own them (FP8, ZeRO-R's CPU checkpointing), of the runtime
    (``ptdp.runtime.startup``), then of the data files and the checkpoint. ``launcher``: this is ptdp's
    launcher (``one_node``: without a multi-node rendezvous), which checks every file before a worker
    starts; its workers skip what it checked."""
    from ptdp.checkpointing.validation import checkpoint_errors, share_verification
    from ptdp.parallel.fp8 import fp8_environment_errors
    from ptdp.parallel.recompute import recompute_environment_errors
    from ptdp.runtime.interrupt import launched
    from ptdp.runtime.startup import startup_problems

    errors = [*fp8_environment_errors(config), *recompute_environment_errors(config), *startup_problems(config)]
    if launcher or not launched():  # the launcher's workers: it checked the data files already
        from ptdp.data.files import data_file_errors

        errors += data_file_errors(config)
    hash_data = True if launcher and one_node else None  # None: one process hashes, ranks share the work
    errors += checkpoint_errors(config, world_size, hash_data=hash_data)
    if launcher and not errors and config.checkpoint.load:
        share_verification(config.checkpoint.load)
    return errors


def _worker_argv(argv: list[str]) -> list[str]:
    """The command line each worker runs: ours without the launcher's own flags."""
    out, skip = [], False
    for arg in argv[1:]:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _LAUNCHER_FLAGS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def _fail(message: str, command: str | None = None) -> int:
    if int(os.environ.get("RANK", "0")) == 0:
        print_error(command, message)
    return 2


# The sub-commands besides train: (name, the module declaring its flags and its function, the module
# running it and its function, help). Each is imported only when its command runs (``_other_parsers``).
_OTHER_COMMANDS = (
    ("plan", "ptdp.planner:add_plan_arguments", "ptdp.planner:run_plan",
     "the fastest layout that fits (t, c, p, d, e, v, b, recomputation, ZeRO) for a model on a cluster"),
    ("simulate", "ptdp.simulate.command:add_simulate_arguments", "ptdp.simulate.command:run_simulate",
     "simulate a pipeline schedule and draw its timeline"),
    ("preprocess", "ptdp.data.preprocess:add_preprocess_arguments", "ptdp.data.preprocess:run_preprocess",
     "tokenize JSONL, Parquet, Arrow or saved Hugging Face datasets into indexed .bin/.idx files"),
    ("samples", "ptdp.cli.samples:add_samples_arguments", "ptdp.cli.samples:run_samples",
     "print the training samples in the order training reads them (the flags of `ptdp train`)"),
    ("generate", "ptdp.cli.generate:add_generate_arguments", "ptdp.cli.generate:run_generate",
     "continue a prompt with a checkpoint (any layout, one process)"),
    ("export", "ptdp.hf.convert:add_export_arguments", "ptdp.megatron.command:run_export",
     "write a checkpoint (any layout) as a Hugging Face GPT-2, Llama, Mixtral or Qwen2-MoE model, or as a "
     "Megatron-LM torch_dist save (--format megatron)"),
    ("import", "ptdp.megatron.command:add_import_arguments", "ptdp.megatron.command:run_import",
     "write a Hugging Face model (model_type gpt2, llama, mixtral or qwen2_moe) or a Megatron-LM save "
     "(--format megatron) as a ptdp checkpoint"),
    ("timeline", "ptdp.observability.timeline:add_timeline_arguments", "ptdp.observability.timeline:run_timeline",
     "merge the per-rank Chrome traces of a --timeline run"),
)


def _function(where: str):
    """``"package.module:name"``, imported."""
    module, name = where.split(":")
    return getattr(importlib.import_module(module), name)


def _other_parsers(sub, command: str | None = None) -> None:
    """The sub-commands besides train. With ``command`` (the one this process runs), only that command's
    module is imported and its flags declared: the others' modules (the planner, the simulator, the
    conversions, ...) cost 0.2-0.4 s of CPU, which every training worker paid for flags it never reads
    (BENCHMARKS.md, "Process start-up"). Their sub-parsers stay, without flags, so ``ptdp --help`` and a
    misspelt command still name them all."""
    for name, declare, run, help_text in _OTHER_COMMANDS:
        p = sub.add_parser(name, help=help_text)
        if command is None or command == name:
            _function(declare)(p)
            p.set_defaults(run=_function(run))


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``ptdp`` parser: every sub-command's flags, or with ``command`` only that one's (the others are
    named, without flags: see :func:`_other_parsers`)."""
    from ptdp import __version__
    from ptdp.cli.parser import Parser

    parser = Parser(prog="ptdp", description=__doc__)
    parser.add_argument("--version", action="version", version=f"ptdp {__version__} ({_torch_version()})")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _other_parsers(sub, command)
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The sub-command ``argv`` names (its first argument that is not an option: ``ptdp`` itself has only
    ``--help`` and ``--version``), or None."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"torch {version('torch')}"
    except PackageNotFoundError:
        return "torch not installed"


def main(argv: list[str] | None = None) -> int:
    from ptdp.cli.parser import parse
    from ptdp.runtime.interrupt import install_for_command

    if argv is None:  # the `ptdp` console script (not a call from Python): Ctrl-C as ptdp/runtime/interrupt.py says
        collector.pause()  # until the imports are done: ptdp/runtime/collector.py
        install_for_command(sys.argv[1:])
        # torch's OpenMP threads (libgomp) spin 300,000 times while they wait for each other: on a machine busy
        # with other work a one-process run then went 5x slower; spinning 10,000 times, then sleeping, holds up
        # there and is no slower idle (BENCHMARKS.md, "Threads of a one-process run"). Set before torch loads;
        # a wait policy or spin count the user set wins.
        if "OMP_WAIT_POLICY" not in os.environ:
            os.environ.setdefault("GOMP_SPINCOUNT", "10000")

    args = parse(build_parser(_command_of(sys.argv[1:] if argv is None else argv)), argv)
    if args.command != "train":  # train resumes once its imports are done (as launcher or as worker)
        collector.resume()
    code = args.run(args)
    if argv is None and args.command == "train":
        exit_now(code)  # a process of its own: skip the interpreter's teardown (ptdp.runtime.exit)
    return code


if __name__ == "__main__":
    sys.exit(main())
