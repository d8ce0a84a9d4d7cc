"""``ptdp preprocess``: JSONL / Parquet / Arrow / ``datasets`` dirs -> Megatron ``PREFIX.bin`` / ``PREFIX.idx``.

Each record is one document; its ``--json-keys`` fields (joined by a blank line when several) are tokenized
and followed by eod. Records are parsed and tokenized in ``--workers`` processes, in ~1 MB chunks, and
written in input order, so the output does not depend on the worker count and memory stays bounded
(inputs.py). The files are Megatron's ``MMIDIDX`` format (indexed_dataset.py), readable by Megatron-LM.
For a Hugging Face tokenizer the tokenizer is saved as ``PREFIX.tokenizer.json`` so ``ptdp train`` finds it
without flags. Malformed JSONL lines (bad JSON, not an object, key missing or not a string) and records
whose column is null are skipped and counted; ``--strict`` makes the first one fatal. The last line on
stdout is one JSON summary for scripts; progress goes to stderr (progress.py). ``--sft`` (chat rows with
``messages``, rendered by the model's chat template, plus a loss mask) is ``preprocess_sft.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator

import numpy as np

from ptdp.data.errors import DataError
from ptdp.data.indexed_dataset import IndexedDatasetWriter, dtype_for_vocab
from ptdp.data.inputs import (
    Malformed,
    Task,
    bounded_imap,
    check_columns,
    document_text,
    expand_inputs,
    fork_pool,
    read_tasks,
)
from ptdp.data.preprocess_sft import run_sft_preprocess
from ptdp.data.progress import Progress
from ptdp.data.tokenizer import TOKENIZER_SUFFIX, BPETokenizer, ByteTokenizer, Tokenizer
from ptdp.data.tokenizer_flags import TOKENIZER_TYPES, build_tokenizer
from ptdp.runtime.errors import print_error


def add_preprocess_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--input", required=True,
                        help="comma-separated JSONL, Parquet or Arrow files, or Hugging Face datasets directories")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                        help="Megatron's tokenizer choice (default: --tokenizer)")
    parser.add_argument("--tokenizer-model", default=None, help="Hugging Face tokenizer directory or tokenizer.json")
    parser.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer vocab.json")
    parser.add_argument("--merge-file", default=None, help="GPT2BPETokenizer merges.txt")
    parser.add_argument("--tokenizer", choices=("byte", "bpe"), default=None,
                        help="byte (default) or bpe (trained here, or the --tokenizer-file)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="BPE vocabulary to train (default 8192); NullTokenizer's vocabulary")
    parser.add_argument(
        "--tokenizer-file",
        default=None,
        help="use this tokenizer.json: a trained BPE PREFIX.tokenizer.json (shared vocab for blends) or a "
        "Llama-style Hugging Face tokenizer.json (documents are BOS + text + EOS)",
    )
    parser.add_argument(
        "--json-keys", default="text", help="comma-separated keys (JSONL) or columns (Parquet/Arrow) of the text"
    )
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--strict", action="store_true", help="fail on the first malformed line")
    parser.add_argument("--progress-interval", type=float, default=10.0,
                        help="seconds between progress lines when stderr is not a terminal")
    parser.add_argument("--sft", action="store_true",
                        help="chat data: JSONL rows with \"messages\", rendered by the model's chat template; also "
                        "writes PREFIX_loss_mask.bin/.idx, 1 on assistant tokens (docs/sft.md)")
    parser.add_argument("--chat-template", default=None,
                        help="with --sft: a Jinja chat template file instead of the tokenizer's own")
    return parser


_worker: dict = {}


def _init_worker(tokenizer: Tokenizer, keys: list[str], dtype: str) -> None:
    _worker["tokenizer"] = tokenizer
    _worker["keys"] = keys
    _worker["dtype"] = np.dtype(dtype)


def _encode_chunk(task: Task) -> tuple[bytes, list[int], list[tuple[str, int, str]], int]:
    """(tokens as bytes in the output dtype, document lengths, malformed (path, line, reason), input bytes)."""
    tok, keys, dtype = _worker["tokenizer"], _worker["keys"], _worker["dtype"]
    texts, malformed = [], []
    for offset, item in enumerate(task.payload):
        if task.kind == "texts":
            if item is None:
                malformed.append((task.path, task.first + offset, f"column {keys[0]!r}... is null, not a string"))
            else:
                texts.append(item)
            continue
        try:
            text = document_text(item, keys)
        except Malformed as err:
            malformed.append((task.path, task.first + offset, str(err)))
            continue
        if text is not None:
            texts.append(text)
    eod = np.array([tok.eod_id], dtype=dtype)
    if isinstance(tok, ByteTokenizer):
        docs = [np.frombuffer(tok.encode_bytes(t), dtype=np.uint8).astype(dtype) for t in texts]
    else:
        docs = [np.asarray(ids, dtype=dtype) for ids in tok.encode_batch(texts)]
    pieces = [x for d in docs for x in (d, eod)]
    data = np.concatenate(pieces).tobytes() if pieces else b""
    return data, [len(d) + 1 for d in docs], malformed, task.nbytes



def _training_texts(files: list[str], keys: list[str], strict: bool, errors: list) -> Iterator[str]:
    for task in read_tasks(files, keys):
        for offset, item in enumerate(task.payload):
            try:
                text = item if task.kind == "texts" else document_text(item, keys)
            except Malformed as err:
                if strict:
                    errors.append((task.path, task.first + offset, str(err)))
                    return
                continue
            if text is not None:
                yield text


def _fail(message: str, code: int) -> int:
    print_error("preprocess", message)
    return code


def _check_flags(args: argparse.Namespace) -> str | None:
    """The first flag conflict as a message, or None; fills ``args.tokenizer``."""
    if args.workers < 1:
        return f"--workers must be >= 1, got {args.workers}"
    if args.tokenizer_type is not None:
        if args.tokenizer is not None or args.tokenizer_file is not None:
            return "--tokenizer-type replaces --tokenizer/--tokenizer-file; give one of them"
        if args.vocab_size is not None and args.tokenizer_type != "NullTokenizer":
            return "--vocab-size applies only to --tokenizer bpe and --tokenizer-type NullTokenizer"
        return None
    if args.tokenizer is None:  # a tokenizer file means BPE; otherwise bytes
        args.tokenizer = "bpe" if args.tokenizer_file is not None else "byte"
    if args.tokenizer == "byte" and args.vocab_size is not None:
        return "--vocab-size applies only to --tokenizer bpe (the byte tokenizer has 257 ids)"
    if args.tokenizer_file is not None and (args.tokenizer != "bpe" or args.vocab_size is not None):
        return "--tokenizer-file needs --tokenizer bpe and no --vocab-size (the file fixes the vocab)"
    return None


def _tokenizer(args: argparse.Namespace, files: list[str], keys: list[str], prefix: str) -> tuple[Tokenizer, str]:
    """(tokenizer, its name in the summary); saves PREFIX.tokenizer.json for the BPE family."""
    if args.tokenizer_type is not None:
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file,
                                    args.vocab_size)
        name = args.tokenizer_type
    elif args.tokenizer_file is not None:
        tokenizer, name = BPETokenizer.from_file(args.tokenizer_file), "bpe"
    elif args.tokenizer == "bpe":
        errors: list = []
        tokenizer = BPETokenizer.train(_training_texts(files, keys, args.strict, errors), args.vocab_size or 8192)
        if errors:
            path, line, reason = errors[0]
            raise _StrictFailure(f"{path}:{line}: malformed line ({reason}); fix it or drop --strict")
        name = "bpe"
    else:
        tokenizer, name = ByteTokenizer(), "byte"
    if isinstance(tokenizer, BPETokenizer):
        tokenizer.save(prefix + TOKENIZER_SUFFIX)
    elif os.path.exists(prefix + TOKENIZER_SUFFIX):  # a stale BPE file would make readers pick BPE
        os.remove(prefix + TOKENIZER_SUFFIX)
    return tokenizer, name


class _StrictFailure(Exception):
    pass


def run_preprocess(args: argparse.Namespace) -> int:
    """Run preprocessing; returns the process exit code (0 ok, 1 malformed under --strict, 2 bad input)."""
    if getattr(args, "sft", False):
        code, result = run_sft_preprocess(args)
        if code:
            return _fail(result, code)
        print(json.dumps(result))
        return 0
    if getattr(args, "chat_template", None) is not None:
        return _fail("--chat-template applies only with --sft", 2)
    start = time.perf_counter()
    keys = [k for k in args.json_keys.split(",") if k]
    problem = _check_flags(args)
    if problem:
        return _fail(problem, 2)
    prefix = args.output_prefix
    out_dir = os.path.dirname(os.path.abspath(prefix))
    try:
        files = expand_inputs([p for p in args.input.split(",") if p])
        check_columns(files, keys)
        os.makedirs(out_dir, exist_ok=True)
    except DataError as err:
        return _fail(str(err), 2)
    except OSError as err:
        return _fail(f"--output-prefix: cannot create {out_dir} ({err.strerror})", 2)

    train_start = time.perf_counter()
    try:
        tokenizer, tokenizer_name = _tokenizer(args, files, keys, prefix)
    except DataError as err:
        return _fail(str(err), 2)
    except _StrictFailure as err:
        return _fail(str(err), 1)
    train_seconds = time.perf_counter() - train_start

    dtype = dtype_for_vocab(tokenizer.vocab_size)
    writer = IndexedDatasetWriter(prefix, tokenizer.vocab_size)
    init = (tokenizer, keys, dtype.str)
    total_bytes = sum(os.path.getsize(p) for p in files)
    malformed: list[tuple[str, int, str]] = []
    pool = None
    code, message = 0, ""
    # Training used the Rust thread pool; workers parallelise by process instead (and fork stays quiet).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    progress = Progress("preprocess", total_bytes, interval=args.progress_interval)
    try:
        if args.workers > 1:
            pool = fork_pool(args.workers, _init_worker, init)
            results = bounded_imap(pool, _encode_chunk, read_tasks(files, keys), 2 * args.workers)
        else:
            _init_worker(*init)
            results = map(_encode_chunk, read_tasks(files, keys))
        for data, lengths, bad, nbytes in results:
            if bad and args.strict:
                path, line, reason = bad[0]
                code, message = 1, f"{path}:{line}: malformed line ({reason}); fix it or drop --strict"
                break
            malformed.extend(bad)
            writer.add_documents(data, lengths)
            progress.update(nbytes, documents=len(lengths), tokens=sum(lengths))
        if code == 0 and writer.num_documents == 0:  # an empty dataset is an error, not a result: write nothing
            code, message = 2, no_document_message(files, keys)
        if code == 0:
            writer.finalize()
    except DataError as err:
        code, message = 2, str(err)
    except BaseException:
        writer.abort()
        raise
    finally:
        progress.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    if code:  # nothing half-written: the temp .bin goes, and so does a tokenizer file saved above
        writer.abort()
        if os.path.exists(prefix + TOKENIZER_SUFFIX) and args.tokenizer_type != "ByteTokenizer":
            os.remove(prefix + TOKENIZER_SUFFIX)
        return _fail(message, code)

    seconds = time.perf_counter() - start
    summary = {
        "documents": writer.num_documents,
        "tokens": writer.num_tokens,
        "output_prefix": prefix,
        "malformed": len(malformed),
        "tokenizer": tokenizer_name,
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype.name,
        "input_bytes": total_bytes,
        "seconds": round(seconds, 3),
        "tokens_per_second": round(writer.num_tokens / max(seconds, 1e-9)),
        "tokenizer_train_seconds": round(train_seconds, 3),
    }
    if malformed:
        path, line, reason = malformed[0]
        summary["first_malformed"] = f"{path}:{line}"
        print(
            f"ptdp preprocess: skipped {len(malformed)} malformed line(s), first {path}:{line} ({reason}); "
            "--strict makes this fatal",
            file=sys.stderr,
        )
    print(json.dumps(summary))
    return 0


def no_document_message(paths: list[str], keys: list[str]) -> str:
    """Why no document came out: the key looked for and the keys the first record has (the usual cause
    is ``--json-keys``), or that the input holds no JSON line at all."""
    wanted = ", ".join(repr(k) for k in keys)
    for path in paths:
        with open(path, "rb") as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except (ValueError, UnicodeDecodeError):
                    return (f"no document written: no line of {', '.join(paths)} is a JSON object with the "
                            f"key(s) {wanted} (--json-keys); the first line of {path} is not valid JSON")
                found = ", ".join(repr(k) for k in record) if isinstance(record, dict) else "none (not an object)"
                return (f"no document written: no record of {', '.join(paths)} has the key(s) {wanted} "
                        f"(--json-keys) as a string; the first record has the keys {found}")
    return f"no document written: {', '.join(paths)} holds no JSON line (the input is empty)"


def main(argv: list[str] | None = None) -> int:
    parser = add_preprocess_arguments(argparse.ArgumentParser(prog="ptdp preprocess", description=__doc__))
    return run_preprocess(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
