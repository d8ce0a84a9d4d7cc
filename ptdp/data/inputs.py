"""``ptdp preprocess`` inputs: JSONL, Parquet, Arrow and local Hugging Face ``datasets`` directories, streamed.

Every source becomes a stream of *tasks* of about ``CHUNK_BYTES`` of input, in input order, so the
preprocessor's memory is bounded by (tasks in flight) x (chunk size) whatever the corpus size:

- JSONL: raw lines (parsed in the worker processes, so JSON decoding is parallel too);
- Parquet: ``ParquetFile.iter_batches`` over only the ``--json-keys`` columns;
- Arrow (IPC stream, as ``datasets.save_to_disk`` writes, or IPC file): memory-mapped record batches;
- a directory: a ``datasets`` save (``state.json`` lists its ``.arrow`` files; a ``DatasetDict`` save uses
  its ``train`` split), else every ``.parquet``/``.arrow``/``.jsonl`` file under it, sorted.

Columns are checked against each file's schema before anything is written, so a missing column is one
line naming the file and nothing half-written. Parquet and Arrow need ``pyarrow`` (``pip install ptdp[data]``).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from ptdp.data.errors import DataError

CHUNK_BYTES = 1 << 20  # input per task ~1 MB: big enough to amortise IPC, small enough to balance
SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")


class Task(NamedTuple):
    kind: str  # "jsonl" (payload: raw lines), "texts" (payload: documents as str) or "rows" (payload: dicts)
    path: str
    first: int  # line / row number of the first item, from 1
    payload: list
    nbytes: int  # input bytes this task accounts for (progress)


class Malformed(Exception):
    pass


def document_text(line: bytes, keys: list[str]) -> str | None:
    """The document of one JSONL line; None for a blank line; raises Malformed with a reason."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError) as err:
        raise Malformed(f"invalid JSON ({err})") from None
    if not isinstance(record, dict):
        raise Malformed("not a JSON object")
    parts = []
    for key in keys:
        value = record.get(key)
        if not isinstance(value, str):
            raise Malformed(f"key {key!r} missing or not a string")
        parts.append(value)
    return "\n\n".join(parts)


def _kind(path: str) -> str:
    for suffix in (".parquet", ".arrow"):
        if path.endswith(suffix):
            return suffix[1:]
    return "jsonl"


def expand_inputs(inputs: list[str]) -> list[str]:
    """Files to read, in order; directories expanded (see the module docstring)."""
    files: list[str] = []
    for path in inputs:
        if not os.path.isdir(path):
            if not os.path.isfile(path) or not os.access(path, os.R_OK):
                raise DataError(f"--input: cannot read {path} (no such readable file); check the path")
            files.append(path)
            continue
        state = os.path.join(path, "state.json")
        if os.path.isfile(os.path.join(path, "dataset_dict.json")):
            if not os.path.isdir(os.path.join(path, "train")):
                raise DataError(f"--input: {path} is a DatasetDict without a 'train' split; pass a split directory")
            state = os.path.join(path, "train", "state.json")
            path = os.path.join(path, "train")
        if os.path.isfile(state):
            with open(state) as f:
                names = [d["filename"] for d in json.load(f).get("_data_files", [])]
            files.extend(os.path.join(path, n) for n in names)
            continue
        found = sorted(os.path.join(root, n) for root, _, names in os.walk(path) for n in names
                       if n.endswith(SUFFIXES))
        if not found:
            raise DataError(f"--input: {path} holds no .jsonl, .parquet or .arrow file")
        files.extend(found)
    if not files:
        raise DataError("--input: no file given; pass --input FILE.jsonl[,FILE.parquet,DIR]")
    return files


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise DataError("--input: Parquet and Arrow inputs need pyarrow (pip install 'ptdp[data]')") from None
    return pyarrow


def _arrow_reader(path: str):
    pa = _pyarrow()
    source = pa.memory_map(path, "r")
    try:
        return pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        try:
            return pa.ipc.open_file(source)
        except pa.ArrowInvalid:
            raise DataError(f"--input: {path} is not an Arrow IPC file or stream") from None


def _check_columns(path: str, names: list[str], keys: list[str], flag: str) -> None:
    missing = [k for k in keys if k not in names]
    if missing:
        raise DataError(f"{flag}: column {missing[0]!r} is not in {path} (columns: {', '.join(names)})")


def check_columns(files: list[str], keys: list[str], flag: str = "--json-keys") -> None:
    """Fail before writing anything when a Parquet/Arrow file lacks a ``--json-keys`` column (``flag``: the
    flag that asked for the columns)."""
    for path in files:
        kind = _kind(path)
        try:
            if kind == "parquet":
                pa = _pyarrow()
                _check_columns(path, pa.parquet.ParquetFile(path).schema_arrow.names, keys, flag)
            elif kind == "arrow":
                _check_columns(path, _arrow_reader(path).schema.names, keys, flag)
        except DataError:
            raise
        except Exception as err:  # pyarrow's errors on corrupt files
            raise DataError(f"--input: cannot read {path} ({str(err).splitlines()[0]})") from None


def _texts(batch, keys: list[str]) -> list[str | None]:
    columns = [batch.column(batch.schema.get_field_index(k)).to_pylist() for k in keys]
    return ["\n\n".join(parts) if all(isinstance(p, str) for p in parts) else None for parts in zip(*columns)]


def _jsonl_tasks(path: str) -> Iterator[Task]:
    with open(path, "rb") as f:
        lines: list[bytes] = []
        size, first = 0, 1
        for lineno, line in enumerate(f, start=1):
            lines.append(line)
            size += len(line)
            if size >= CHUNK_BYTES:
                yield Task("jsonl", path, first, lines, size)
                lines, size, first = [], 0, lineno + 1
        if lines:
            yield Task("jsonl", path, first, lines, size)


def _rows(batch, keys: list[str]) -> list[dict]:
    """Each row as ``{key: value}`` (nested lists and structs as Python lists and dicts)."""
    columns = [batch.column(batch.schema.get_field_index(k)).to_pylist() for k in keys]
    return [dict(zip(keys, values)) for values in zip(*columns)]


def _batch_tasks(path: str, batches, total_rows: int | None, keys: list[str], rows: bool) -> Iterator[Task]:
    file_size, row = os.path.getsize(path), 1
    for batch in batches:
        if batch.num_rows == 0:
            continue
        nbytes = file_size * batch.num_rows // total_rows if total_rows else batch.nbytes
        yield (Task("rows", path, row, _rows(batch, keys), nbytes) if rows
               else Task("texts", path, row, _texts(batch, keys), nbytes))
        row += batch.num_rows


def read_tasks(files: list[str], keys: list[str], rows: bool = False) -> Iterator[Task]:
    """The tasks of ``files`` in order; a Parquet/Arrow task holds the ``keys`` columns joined as text, or
    with ``rows`` each row's ``{key: value}`` (structured columns such as chat ``messages``)."""
    for path in files:
        kind = _kind(path)
        if kind == "jsonl":
            yield from _jsonl_tasks(path)
        elif kind == "parquet":
            # Without pre-buffering and with a bounded read buffer: pyarrow's default pre-buffers column chunks
            # ahead and the process grows with the file (benchmarks/preprocess.py measured 1.4 GB for 1 GB).
            pf = _pyarrow().parquet.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False)
            total = pf.metadata.num_rows
            per_row = max(1, os.path.getsize(path) // max(total, 1))  # compressed bytes per row
            batch_rows = max(1, min(65536, CHUNK_BYTES // per_row))
            yield from _batch_tasks(path, pf.iter_batches(batch_size=batch_rows, columns=keys), total, keys, rows)
        else:
            reader = _arrow_reader(path)
            if isinstance(reader, _pyarrow().ipc.RecordBatchFileReader):  # IPC file format: batches by index
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            else:
                batches = iter(reader)
            yield from _batch_tasks(path, (b.select(keys) for b in batches), None, keys, rows)


def bounded_imap(pool, fn: Callable, tasks: Iterable, max_pending: int) -> Iterator:
    """``pool.imap(fn, tasks)`` in order, reading at most ``max_pending`` tasks ahead (``Pool.imap`` reads
    the whole input at once: a 100 GB corpus would be read into the parent before the first chunk comes back)."""
    pending: deque = deque()
    for task in tasks:
        pending.append(pool.apply_async(fn, (task,)))
        if len(pending) >= max_pending:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def fork_pool(workers: int, initializer: Callable, initargs: tuple):
    """A pool of ``workers`` forked processes (the tokenizer in ``initargs`` is inherited, never pickled),
    each started with SIGTERM's default action before ``initializer(*initargs)``.

    ``Pool.terminate`` takes the task queue's lock and keeps it, and stops a worker still waiting for that
    lock by SIGTERM alone. A worker forked from a process that handles SIGTERM in Python (a program that
    calls the preprocessor may) would inherit the handler; one that returns, as a handler that only records
    the signal does, leaves the worker waiting for the lock and ``terminate`` waiting for the worker."""
    return mp.get_context("fork").Pool(workers, initializer=_start_worker, initargs=(initializer, *initargs))


def _start_worker(initializer: Callable, *initargs) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    initializer(*initargs)
