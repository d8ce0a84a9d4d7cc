"""``ptdp preprocess --sft``: chat conversations (JSONL, Parquet or Arrow rows with ``messages``) -> token ids
and loss mask.

Each row ``{"messages": [{"role": ..., "content": ...}, ...]}`` is one document: the ids are the model's chat
template rendered by transformers' ``apply_chat_template`` (``chat.py``: exactly its ids, no end-of-document
token added), written as ``PREFIX.bin/.idx``; beside them ``PREFIX_loss_mask.bin/.idx``, the same format
(uint8, the same sequence lengths), 1 on the tokens of the assistant turns (the template's generation
markers, else by role: ``chat.py``). Rows are rendered in ``--workers`` processes in input order, so the
output does not depend on the worker count. Every bad row (not JSON, no ``messages``, an unknown role, no
assistant turn, a template error) is one line naming the file and the row (its 1-based line or row), exit 2, and
nothing is written: the files are published by rename only at the end. ``PREFIX.tokenizer.json`` is saved
too, so ``ptdp train --sft --data-path PREFIX`` finds the tokenizer without flags.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from ptdp.data.chat import (
    BadRow,
    check_messages,
    encode_conversation,
    has_generation_markers,
    load_chat_tokenizer,
)
from ptdp.data.errors import DataError
from ptdp.data.indexed_dataset import IndexedDatasetWriter
from ptdp.data.inputs import Task, bounded_imap, check_columns, expand_inputs, fork_pool, read_tasks
from ptdp.data.progress import Progress
from ptdp.data.sft_dataset import LOSS_MASK_SUFFIX
from ptdp.data.tokenizer import TOKENIZER_SUFFIX
from ptdp.data.tokenizer_flags import build_tokenizer

_worker: dict = {}


def _init_worker(tok, markers: bool, dtype: str) -> None:
    _worker.update(tok=tok, markers=markers, dtype=np.dtype(dtype))


def _record(kind: str, item) -> dict:
    """One row: a JSONL line parsed, or a Parquet/Arrow row with its messages' null fields dropped (a column
    of structs gives every message every field; a null one is one the row does not have)."""
    if kind != "jsonl":
        messages = item.get("messages")
        if isinstance(messages, list):
            messages = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in messages]
        return {**item, "messages": messages}
    try:
        return json.loads(item)
    except (ValueError, UnicodeDecodeError) as err:
        raise BadRow(f"invalid JSON ({err})") from None


def _encode_chunk(task: Task) -> tuple[bytes, bytes, list[int], tuple[str, int, str] | None, int]:
    """(ids in the output dtype, mask as uint8, lengths, the first bad row (path, line, reason), input bytes)."""
    tok, markers, dtype = _worker["tok"], _worker["markers"], _worker["dtype"]
    ids_parts, mask_parts, lengths = [], [], []
    for offset, line in enumerate(task.payload):
        if task.kind == "jsonl" and not line.strip():
            continue
        row = task.first + offset
        try:
            ids, mask = encode_conversation(tok, check_messages(_record(task.kind, line)), markers)
        except BadRow as err:
            return b"", b"", [], (task.path, row, str(err)), task.nbytes
        ids_parts.append(np.asarray(ids, dtype=dtype))
        mask_parts.append(np.asarray(mask, dtype=np.uint8))
        lengths.append(len(ids))
    data = np.concatenate(ids_parts).tobytes() if ids_parts else b""
    masks = np.concatenate(mask_parts).tobytes() if mask_parts else b""
    return data, masks, lengths, None, task.nbytes



def _check(args: argparse.Namespace) -> None:
    if args.tokenizer_type != "HuggingFaceTokenizer" or args.tokenizer is not None or args.tokenizer_file:
        raise DataError("--sft renders the model's chat template: give --tokenizer-type HuggingFaceTokenizer "
                        "--tokenizer-model DIR (and --chat-template FILE if DIR has none)")
    if args.json_keys != "text":
        raise DataError("--sft reads each row's \"messages\"; --json-keys does not apply")
    if args.workers < 1:
        raise DataError(f"--workers must be >= 1, got {args.workers}")


def run_sft_preprocess(args: argparse.Namespace) -> tuple[int, str | dict]:
    """(0, JSON summary) or (exit code, one-line message); writes nothing unless it succeeds."""
    start = time.perf_counter()
    try:
        _check(args)
        files = expand_inputs([p for p in args.input.split(",") if p])
        check_columns(files, ["messages"], "--sft")
        tok = load_chat_tokenizer(args.tokenizer_model, args.chat_template)
        tokenizer = build_tokenizer("HuggingFaceTokenizer", args.tokenizer_model)
    except DataError as err:
        return 2, str(err)
    prefix = args.output_prefix
    try:
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    except OSError as err:
        return 2, f"--output-prefix: cannot create the directory of {prefix} ({err.strerror})"
    markers = has_generation_markers(tok.chat_template)
    writer = IndexedDatasetWriter(prefix, tokenizer.vocab_size)
    masks = IndexedDatasetWriter(prefix + LOSS_MASK_SUFFIX, 0, dtype=np.uint8)
    init = (tok, markers, writer.dtype.str)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    progress = Progress("preprocess", sum(os.path.getsize(p) for p in files), interval=args.progress_interval)
    pool, failure = None, None
    assistant = 0
    try:
        if args.workers > 1:
            pool = fork_pool(args.workers, _init_worker, init)
            results = bounded_imap(pool, _encode_chunk, read_tasks(files, ["messages"], rows=True), 2 * args.workers)
        else:
            _init_worker(*init)
            results = map(_encode_chunk, read_tasks(files, ["messages"], rows=True))
        for data, mask, lengths, bad_row, nbytes in results:
            if bad_row is not None:
                path, row, reason = bad_row
                failure = f"{path}: row {row}: {reason}"
                break
            writer.add_documents(data, lengths)
            masks.add_documents(mask, lengths)
            assistant += int(np.frombuffer(mask, dtype=np.uint8).sum())
            progress.update(nbytes, documents=len(lengths), tokens=sum(lengths))
        if failure is None and writer.num_documents == 0:
            failure = f"no conversation written: {', '.join(files)} holds no row"
        if failure is None:
            masks.finalize()  # the mask first: a visible PREFIX.idx always has its mask beside it
            writer.finalize()
            tokenizer.save(prefix + TOKENIZER_SUFFIX)
    except BaseException:
        writer.abort()
        masks.abort()
        raise
    finally:
        progress.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    if failure is not None:
        writer.abort()
        masks.abort()
        return 2, failure
    seconds = time.perf_counter() - start
    return 0, {
        "documents": writer.num_documents, "tokens": writer.num_tokens, "assistant_tokens": assistant,
        "output_prefix": prefix, "loss_mask_prefix": prefix + LOSS_MASK_SUFFIX,
        "mask_rule": "generation markers" if markers else "by role", "tokenizer": "HuggingFaceTokenizer",
        "vocab_size": tokenizer.vocab_size, "dtype": writer.dtype.name, "seconds": round(seconds, 3),
    }
