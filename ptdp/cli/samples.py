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

from ptdp.checkpointing.storage import latest_info
from ptdp.config import ConfigError, add_config_arguments, config_from_args, derive, validate
from ptdp.data import DataError
from ptdp.data.documents import DocumentOptions
from ptdp.data.samples import batch_indices, iter_samples, sample_record
from ptdp.data.training_data import datasets_for_config
from ptdp.runtime.errors import print_error

LAUNCH_FLAGS = ("--nproc-per-node", "--nnodes", "--max-restarts", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf",
                "--monitor-interval")


def add_samples_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_config_arguments(parser)
    launch = parser.add_argument_group("launch (as in `ptdp train`; the world size sets d)")
    for flag in LAUNCH_FLAGS:
        launch.add_argument(flag, default=None)
    launch.add_argument("--elastic", action="store_true")
    show = parser.add_argument_group("samples")
    show.add_argument("--first", type=int, default=None, help="how many samples to print (default 10; with "
                      "--iteration, the first samples of that batch in the order the ranks read them, default all)")
    show.add_argument("--start", type=int, default=None, help="index of the first sample in the training order "
                      "(default 0)")
    show.add_argument("--iteration", type=int, default=None,
                      help="print every sample of global batch N (iterations count from 1, as in the log)")
    show.add_argument("--split-name", choices=("train", "valid", "test"), default="train")
    show.add_argument("--decode", action="store_true", help="add the detokenized \"text\" (with --sft: the "
                      "tokens that carry the loss between [[ and ]])")
    show.add_argument("--format", choices=("json", "text"), default="json")
    return parser


def _world_size(args: argparse.Namespace) -> int:
    if args.nproc_per_node is not None:
        nodes = str(args.nnodes or "1").split(":")[-1]
        return int(args.nproc_per_node) * int(nodes)
    return int(os.environ.get("WORLD_SIZE", "1"))


def _text_view(record: dict) -> str:
    head = (f"sample {record['sample']} | iteration {record['iteration']} | dp_rank {record['dp_rank']} | "
            f"microbatch {record['microbatch']} | {record['dataset']} | documents {record['document_ids']}"
            + (f" | cu_seqlens {record['cu_seqlens']}" if "cu_seqlens" in record else "")
            + (f" | out of the loss {record['loss_masked_positions']}" if "loss_masked_positions" in record else "")
            + (f" | conversations {record['conversations']} | loss on [[...]]" if "conversations" in record else ""))
    body = record.get("text")
    return head + "\n" + (body if body is not None else " ".join(map(str, record["tokens"]))) + "\n"


def _fail(message: str) -> int:
    print_error("samples", message)
    return 2


def run_samples(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as err:
        return _fail(str(err))
    world = _world_size(args)
    errors = validate(config, world)
    if errors:
        return _fail(errors[0])
    config = derive(config)
    if (args.first or 0) < 0 or (args.start or 0) < 0:
        return _fail("--first and --start must be >= 0")
    if args.iteration is not None and args.start is not None:
        return _fail(f"--start {args.start} and --iteration {args.iteration}: give one of them (--iteration N "
                     "--first K prints the first K samples of global batch N)")
    tr, par = config.training, config.parallel
    dp = world // (par.tensor_model_parallel_size * par.pipeline_model_parallel_size * par.context_parallel_size)
    if args.iteration is not None and args.iteration < 1:
        return _fail(f"--iteration counts from 1, got {args.iteration}")
    try:  # like `ptdp train`: a --load DIR without a checkpoint starts fresh
        saved, directory = latest_info(config.checkpoint.load)
    except Exception as err:  # CheckpointError and unreadable files: one line either way
        return _fail(str(err).splitlines()[0])
    problem = _batch_problem(saved, directory, tr.global_batch_size) if saved is not None else None
    if problem:
        return _fail(problem)
    try:
        splits = datasets_for_config(config, saved, directory)
        dataset = {"train": splits.train, "valid": splits.valid, "test": splits.test}[args.split_name]
        if dataset is None:
            d = config.data
            source = (f"(no --{args.split_name}-data-path)" if d.train_data_path or d.valid_data_path or
                      d.test_data_path else f"of --split {d.split}")
            return _fail(f"--split-name {args.split_name}: the {args.split_name} split {source} is empty")
        tokenizer = splits.tokenizer if args.decode else None
        d = config.data
        documents = DocumentOptions(splits.tokenizer.eod_id, d.reset_position_ids, d.reset_attention_mask,
                                    d.eod_mask_loss, d.sft)
        if args.iteration is not None:  # the whole batch, or its first --first samples
            rows = [(i, args.iteration, r, j) for i, r, j in
                    batch_indices(args.iteration, tr.global_batch_size, dp, tr.micro_batch_size)][:args.first]
        else:
            start, first = args.start or 0, 10 if args.first is None else args.first
            rows = iter_samples(dataset, tr.global_batch_size, dp, tr.micro_batch_size, range(start, start + first))
        for i, iteration, rank, micro in rows:
            record = sample_record(dataset, i, iteration, rank, micro, tokenizer, documents if documents.any else None)
            sys.stdout.write(_text_view(record) if args.format == "text" else json.dumps(record) + "\n")
            sys.stdout.flush()
    except DataError as err:
        return _fail(str(err))
    except BrokenPipeError:  # `ptdp samples ... | head`
        return 0
    return 0


def _batch_problem(info: dict, directory: str | None, global_batch: int) -> str | None:
    """A problem of ``--global-batch-size`` with the checkpoint ``info`` as one line, or None. A checkpoint with a
    data state continues at its consumed samples whatever ``B`` is (``ptdp/data/train_stream.py``); an older
    one is read by iteration, so it must agree (consumed = iteration x B)."""
    consumed = info.get("consumed_samples")
    if consumed is not None and "data" not in info and consumed != int(info["iteration"]) * global_batch:
        return (f"--global-batch-size {global_batch}: the checkpoint at {directory} consumed {consumed} samples in "
                f"{info['iteration']} iterations; pass the run's global batch size")
    return None
