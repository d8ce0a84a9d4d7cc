"""``ptdp preprocess``: JSONL -> ``PREFIX.bin`` / ``PREFIX.idx`` (+ ``PREFIX.tokenizer.json`` for BPE).

Each JSON line is one document; its ``--json-keys`` fields (joined by a blank line when several) are
tokenized and followed by eod. Lines are parsed and tokenized in ``--workers`` processes, in chunks, and
written in input order, so the output does not depend on the worker count. Malformed lines (bad JSON,
not an object, key missing or not a string) are skipped and counted; ``--strict`` makes the first one
fatal. The last line on stdout is one JSON summary for scripts; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from collections.abc import Iterator

import numpy as np

from ptdp.data.errors import DataError
from ptdp.data.indexed_dataset import IndexedDatasetWriter, dtype_for_vocab
from ptdp.data.tokenizer import TOKENIZER_SUFFIX, BPETokenizer, ByteTokenizer
from ptdp.errors import print_error

CHUNK_BYTES = 1 << 20  # lines per task ~1 MB: big enough to amortise IPC, small enough to balance


def add_preprocess_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--input", required=True, help="JSONL file(s), comma-separated")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--tokenizer", choices=("byte", "bpe"), default=None,
                        help="byte (default) or bpe (trained here, or the --tokenizer-file)")
    parser.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary to train (default 8192)")
    parser.add_argument(
        "--tokenizer-file",
        default=None,
        help="use this tokenizer.json: a trained BPE PREFIX.tokenizer.json (shared vocab for blends) or a "
        "Llama-style Hugging Face tokenizer.json (documents are BOS + text + EOS)",
    )
    parser.add_argument(
        "--json-keys", default="text", help="comma-separated keys whose text forms a document"
    )
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--strict", action="store_true", help="fail on the first malformed line")
    return parser


class _Malformed(Exception):
    pass


def _document_text(line: bytes, keys: list[str]) -> str | None:
    """The document of one JSONL line; None for a blank line; raises _Malformed with a reason."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError) as err:
        raise _Malformed(f"invalid JSON ({err})") from None
    if not isinstance(record, dict):
        raise _Malformed("not a JSON object")
    parts = []
    for key in keys:
        value = record.get(key)
        if not isinstance(value, str):
            raise _Malformed(f"key {key!r} missing or not a string")
        parts.append(value)
    return "\n\n".join(parts)


def _read_chunks(paths: list[str]) -> Iterator[tuple[str, int, list[bytes]]]:
    """(path, first line number, lines) in ~CHUNK_BYTES pieces, in input order."""
    for path in paths:
        with open(path, "rb") as f:
            lines: list[bytes] = []
            size, first = 0, 1
            for lineno, line in enumerate(f, start=1):
                lines.append(line)
                size += len(line)
                if size >= CHUNK_BYTES:
                    yield path, first, lines
                    lines, size, first = [], 0, lineno + 1
            if lines:
                yield path, first, lines


_worker: dict = {}


def _init_worker(tokenizer_path: str | None, keys: list[str], dtype: str) -> None:
    _worker["tokenizer"] = BPETokenizer.from_file(tokenizer_path) if tokenizer_path else ByteTokenizer()
    _worker["keys"] = keys
    _worker["dtype"] = np.dtype(dtype)


def _encode_chunk(
    task: tuple[str, int, list[bytes]],
) -> tuple[bytes, list[int], list[tuple[str, int, str]], int]:
    """(tokens as bytes in the output dtype, document lengths, malformed (path, line, reason), input bytes)."""
    path, first, lines = task
    tok, keys, dtype = _worker["tokenizer"], _worker["keys"], _worker["dtype"]
    texts, malformed = [], []
    for offset, line in enumerate(lines):
        try:
            text = _document_text(line, keys)
        except _Malformed as err:
            malformed.append((path, first + offset, str(err)))
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
    return data, [len(d) + 1 for d in docs], malformed, sum(len(line) for line in lines)


def _bounded_imap(pool, tasks: Iterator, max_pending: int) -> Iterator:
    """Ordered ``pool.imap`` that reads ahead at most ``max_pending`` chunks (Pool.imap reads all input)."""
    pending: deque = deque()
    for task in tasks:
        pending.append(pool.apply_async(_encode_chunk, (task,)))
        if len(pending) >= max_pending:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _training_texts(paths: list[str], keys: list[str], strict: bool, errors: list) -> Iterator[str]:
    for path, first, lines in _read_chunks(paths):
        for offset, line in enumerate(lines):
            try:
                text = _document_text(line, keys)
            except _Malformed as err:
                if strict:
                    errors.append((path, first + offset, str(err)))
                    return
                continue
            if text is not None:
                yield text


def _fail(message: str, code: int) -> int:
    print(f"ptdp preprocess: {message}", file=sys.stderr)
    return code


def run_preprocess(args: argparse.Namespace) -> int:
    """Run preprocessing; returns the process exit code (0 ok, 1 data error, 2 bad arguments)."""
    from tqdm import tqdm

    start = time.perf_counter()
    paths = [p for p in args.input.split(",") if p]
    keys = [k for k in args.json_keys.split(",") if k]
    if not paths:
        return _fail("--input: no file given; pass --input FILE.jsonl[,FILE2.jsonl]", 2)
    for path in paths:
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            return _fail(f"--input: cannot read {path} (no such readable file); check the path", 2)
    if args.workers < 1:
        return _fail(f"--workers must be >= 1, got {args.workers}", 2)
    if args.tokenizer is None:  # a tokenizer file means BPE; otherwise bytes
        args.tokenizer = "bpe" if args.tokenizer_file is not None else "byte"
    if args.tokenizer == "byte" and args.vocab_size is not None:
        return _fail("--vocab-size applies only to --tokenizer bpe (the byte tokenizer has 257 ids)", 2)
    if args.tokenizer_file is not None and (args.tokenizer != "bpe" or args.vocab_size is not None):
        return _fail(
            "--tokenizer-file needs --tokenizer bpe and no --vocab-size (the file fixes the vocab)", 2
        )
    prefix = args.output_prefix
    out_dir = os.path.dirname(os.path.abspath(prefix))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as err:
        return _fail(f"--output-prefix: cannot create {out_dir} ({err.strerror})", 2)

    tokenizer_path = None
    try:
        train_start = time.perf_counter()
        if args.tokenizer_file is not None:
            tokenizer = BPETokenizer.from_file(args.tokenizer_file)
            tokenizer_path = prefix + TOKENIZER_SUFFIX
            tokenizer.save(tokenizer_path)
        elif args.tokenizer == "bpe":
            errors: list = []
            tokenizer = BPETokenizer.train(
                _training_texts(paths, keys, args.strict, errors), args.vocab_size or 8192
            )
            if errors:
                path, line, reason = errors[0]
                return _fail(f"{path}:{line}: malformed line ({reason}); fix it or drop --strict", 1)
            tokenizer_path = prefix + TOKENIZER_SUFFIX
            tokenizer.save(tokenizer_path)
        else:
            tokenizer = ByteTokenizer()
            if os.path.exists(prefix + TOKENIZER_SUFFIX):  # a stale BPE file would make readers pick BPE
                os.remove(prefix + TOKENIZER_SUFFIX)
    except DataError as err:
        return _fail(str(err), 2)
    train_seconds = time.perf_counter() - train_start

    dtype = dtype_for_vocab(tokenizer.vocab_size)
    writer = IndexedDatasetWriter(prefix, tokenizer.vocab_size)
    init = (tokenizer_path, keys, dtype.str)
    total_bytes = sum(os.path.getsize(p) for p in paths)
    malformed: list[tuple[str, int, str]] = []
    pool = None
    # Training used the Rust thread pool; workers parallelise by process instead (and fork stays quiet).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        if args.workers > 1:
            pool = mp.get_context("fork").Pool(args.workers, initializer=_init_worker, initargs=init)
            results = _bounded_imap(pool, _read_chunks(paths), 2 * args.workers)
        else:
            _init_worker(*init)
            results = map(_encode_chunk, _read_chunks(paths))
        with tqdm(
            total=total_bytes, unit="B", unit_scale=True, file=sys.stderr, disable=None, desc="preprocess"
        ) as bar:
            for data, lengths, bad, nbytes in results:
                if bad and args.strict:
                    path, line, reason = bad[0]
                    writer.abort()
                    if tokenizer_path is not None and os.path.exists(tokenizer_path):
                        os.remove(tokenizer_path)
                    return _fail(f"{path}:{line}: malformed line ({reason}); fix it or drop --strict", 1)
                malformed.extend(bad)
                writer.add_documents(data, lengths)
                bar.update(nbytes)
        if writer.num_documents == 0:  # an empty dataset is an error, not a result: write nothing
            writer.abort()
            if tokenizer_path is not None and os.path.exists(tokenizer_path):
                os.remove(tokenizer_path)
            print_error("preprocess", no_document_message(paths, keys))
            return 2
        writer.finalize()
    except BaseException:
        writer.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()

    seconds = time.perf_counter() - start
    summary = {
        "documents": writer.num_documents,
        "tokens": writer.num_tokens,
        "output_prefix": prefix,
        "malformed": len(malformed),
        "tokenizer": args.tokenizer,
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype.name,
        "input_bytes": total_bytes,
        "seconds": round(seconds, 3),
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
