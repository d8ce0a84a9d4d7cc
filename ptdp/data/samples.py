"""``ptdp samples``: the training samples in the order training reads them, one JSON object per line.

It takes ``ptdp train``'s flags (or its ``--config``), so a user pastes the training command and changes
the verb, and it runs training's own data code: :func:`datasets_for_config` builds (or memory-maps from
``--data-cache-path``) the same datasets, and :func:`microbatch_positions` gives the same (data-parallel
rank, microbatch) of every sample. Nothing is loaded whole: the ``.bin`` files are memory-mapped and only the
printed samples are read.

Sample ``i`` of the training order is in global batch (iteration) ``i // B + 1``; inside it, data-parallel
rank ``r`` takes positions ``[r*B/d, (r+1)*B/d)`` and microbatch ``j`` rows ``[j*b, (j+1)*b)`` of that slice.
``tokens``/``labels`` are ``text[:-1]``/``text[1:]`` of the ``seq_length + 1`` ids, as in Megatron's GPTDataset.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator

from ptdp.data.errors import DataError
from ptdp.data.microbatch import microbatch_positions

LAUNCH_FLAGS = ("--nproc-per-node", "--nnodes", "--max-restarts", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf",
                "--monitor-interval")


def add_samples_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from ptdp.config import add_config_arguments

    add_config_arguments(parser)
    launch = parser.add_argument_group("launch (as in `ptdp train`; the world size sets d)")
    for flag in LAUNCH_FLAGS:
        launch.add_argument(flag, default=None)
    launch.add_argument("--elastic", action="store_true")
    show = parser.add_argument_group("samples")
    show.add_argument("--first", type=int, default=10, help="how many samples to print (default 10)")
    show.add_argument("--start", type=int, default=0, help="index of the first sample in the training order")
    show.add_argument("--iteration", type=int, default=None,
                      help="print every sample of global batch N (iterations count from 1, as in the log)")
    show.add_argument("--split-name", choices=("train", "valid", "test"), default="train")
    show.add_argument("--decode", action="store_true", help="add the detokenized \"text\"")
    show.add_argument("--format", choices=("json", "text"), default="json")
    return parser


def _world_size(args: argparse.Namespace) -> int:
    if args.nproc_per_node is not None:
        nodes = str(args.nnodes or "1").split(":")[-1]
        return int(args.nproc_per_node) * int(nodes)
    return int(os.environ.get("WORLD_SIZE", "1"))


def sample_record(dataset, i: int, iteration: int, dp_rank: int, microbatch: int, tokenizer=None) -> dict:
    """One sample as ``ptdp samples`` prints it (``dataset`` is a GPTDataset or a BlendedDataset)."""
    member, k = dataset.locate(i) if hasattr(dataset, "locate") else (dataset, i)
    text = member[k]
    record = {"sample": i, "iteration": iteration, "dp_rank": dp_rank, "microbatch": microbatch,
              "dataset": member.indexed.prefix, "dataset_sample": k, "document_ids": member.document_ids(k),
              "tokens": text[:-1].tolist(), "labels": text[1:].tolist()}
    if tokenizer is not None:
        record["text"] = tokenizer.decode(record["tokens"])
    return record


def iter_samples(dataset, global_batch: int, dp: int, micro: int, indices: Iterator[int] | list[int]):
    """(sample index, iteration, dp rank, microbatch) for ``indices`` of the training order."""
    per_rank = global_batch // dp
    for i in indices:
        q = i % global_batch
        yield i, i // global_batch + 1, q // per_rank, (q % per_rank) // micro


def batch_indices(iteration: int, global_batch: int, dp: int, micro: int) -> list[tuple[int, int, int]]:
    """(sample index, dp rank, microbatch) of every sample of global batch ``iteration`` (from 1), in the order
    each rank reads them; the same function the trainer's ``get_microbatch`` uses."""
    out = []
    for r in range(dp):
        for j in range(global_batch // (dp * micro)):
            out.extend((i, r, j) for i in microbatch_positions(iteration - 1, global_batch, r, dp, micro, j))
    return out


def _text_view(record: dict) -> str:
    head = (f"sample {record['sample']} | iteration {record['iteration']} | dp_rank {record['dp_rank']} | "
            f"microbatch {record['microbatch']} | {record['dataset']} | documents {record['document_ids']}")
    body = record.get("text")
    return head + "\n" + (body if body is not None else " ".join(map(str, record["tokens"]))) + "\n"


def _fail(message: str) -> int:
    from ptdp.runtime.errors import print_error

    print_error("samples", message)
    return 2


def run_samples(args: argparse.Namespace) -> int:
    from ptdp.config import ConfigError, config_from_args, derive, validate
    from ptdp.data.training_data import datasets_for_config

    try:
        config = config_from_args(args)
    except ConfigError as err:
        return _fail(str(err))
    world = _world_size(args)
    errors = validate(config, world)
    if errors:
        return _fail(errors[0])
    config = derive(config, world)
    if args.first < 0 or args.start < 0:
        return _fail("--first and --start must be >= 0")
    tr, par = config.training, config.parallel
    dp = world // (par.tensor_model_parallel_size * par.pipeline_model_parallel_size * par.context_parallel_size)
    if args.iteration is not None and args.iteration < 1:
        return _fail(f"--iteration counts from 1, got {args.iteration}")
    if config.checkpoint.load:
        problem = _check_load(config.checkpoint.load, tr.global_batch_size)
        if problem:
            return _fail(problem)
    try:
        splits = datasets_for_config(config)
        dataset = getattr(splits, args.split_name)
        if dataset is None:
            d = config.data
            source = (f"(no --{args.split_name}-data-path)" if d.train_data_path or d.valid_data_path or
                      d.test_data_path else f"of --split {d.split}")
            return _fail(f"--split-name {args.split_name}: the {args.split_name} split {source} is empty")
        tokenizer = splits.tokenizer if args.decode else None
        if args.iteration is not None:
            rows = [(i, args.iteration, r, j) for i, r, j in
                    batch_indices(args.iteration, tr.global_batch_size, dp, tr.micro_batch_size)]
        else:
            rows = iter_samples(dataset, tr.global_batch_size, dp, tr.micro_batch_size,
                                range(args.start, args.start + args.first))
        for i, iteration, rank, micro in rows:
            record = sample_record(dataset, i, iteration, rank, micro, tokenizer)
            sys.stdout.write(_text_view(record) if args.format == "text" else json.dumps(record) + "\n")
            sys.stdout.flush()
    except DataError as err:
        return _fail(str(err))
    except BrokenPipeError:  # `ptdp samples ... | head`
        return 0
    return 0


def _check_load(path: str, global_batch: int) -> str | None:
    """A problem with ``--load`` as one line, or None. A checkpoint with a data state continues at its consumed
    samples whatever ``B`` is (``train_stream.py``); an older one is read by iteration, so it must agree
    (consumed = iteration x B)."""
    from ptdp.checkpointing.storage import read_info, resolve

    try:
        directory = resolve(path)
        if directory is None:
            return None  # like `ptdp train`: a DIR without a checkpoint starts fresh
        info = read_info(directory)
    except Exception as err:  # CheckpointError and unreadable files: one line either way
        return str(err).splitlines()[0]
    consumed = info.get("consumed_samples")
    if consumed is not None and "data" not in info and consumed != int(info["iteration"]) * global_batch:
        return (f"--global-batch-size {global_batch}: the checkpoint at {directory} consumed {consumed} samples in "
                f"{info['iteration']} iterations; pass the run's global batch size")
    return None
