"""Indexed token files in Megatron-LM's ``MMIDIDX`` format: ``PREFIX.bin`` (tokens) + ``PREFIX.idx`` (index).

The same format serves user data (written by ``ptdp preprocess``), the default corpus, and corpora already
tokenized by Megatron's ``tools/preprocess_data.py``, so a Megatron user's terabytes load as they are and
Megatron reads what ptdp writes. Readers memory-map both files: a rank touches only the pages of the
samples it reads, and 8 ranks on one machine share the page cache.

``.idx`` layout (little endian; field by field in docs/data.md)::

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    <Q        version (1)
    <B        dtype code of .bin (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
    <Q        sequence count n
    <Q        document count k
    int32[n]  sequence lengths in tokens
    int64[n]  byte pointers of each sequence in .bin
    int64[k]  document indices: the first sequence of each document, starting at 0, last = n

ptdp writes one sequence per document (as Megatron does without sentence splitting), so "documents" below
are sequences, which is also what Megatron's GPTDataset splits and samples over. Files in ptdp's earlier
``PTDPIDX`` format still load (read-only). Writers go through temp files + ``os.replace`` so a concurrent
reader sees either no file or a whole one.
"""

from __future__ import annotations

import os
import struct
import uuid

import numpy as np

from ptdp.data.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count: 34 bytes
DTYPE_CODES = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32), 8: np.dtype(np.uint16),
}
CODE_OF_DTYPE = {dt: code for code, dt in DTYPE_CODES.items()}
LEGACY_MAGIC = b"PTDPIDX\x00"  # ptdp's format before MMIDIDX: magic, <I version, <I code, <Q n, int64[n+1]
LEGACY_HEADER = struct.Struct("<8sIIQ")
LEGACY_DTYPES = {1: np.dtype(np.uint16), 2: np.dtype(np.int32)}


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 halves disk and page-cache use whenever every id fits (vocab <= 65536), else int32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.int32)


def _tmp_path(path: str) -> str:
    return f"{path}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}"


def write_index(path: str, dtype: np.dtype, lengths: np.ndarray) -> None:
    """Write an ``MMIDIDX`` index for contiguous sequences of ``lengths`` tokens, one document each."""
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    documents = np.arange(len(lengths) + 1, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[np.dtype(dtype)], len(lengths), len(documents)))
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(documents.tobytes())


class IndexedDatasetWriter:
    """Append documents, then :meth:`finalize` publishes ``PREFIX.bin`` and ``PREFIX.idx`` atomically.

    .bin is renamed into place before .idx and readers open .idx first, so a visible .idx always has its
    complete .bin beside it.
    """

    def __init__(self, prefix: str, vocab_size: int, dtype: np.dtype | None = None) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype) if dtype is not None else dtype_for_vocab(vocab_size)
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._bin_tmp = _tmp_path(prefix + ".bin")
        self._bin = open(self._bin_tmp, "wb")
        self._lengths: list[int] = []

    def add_document(self, tokens) -> None:
        arr = np.asarray(tokens)
        if arr.dtype != self.dtype:
            arr = arr.astype(self.dtype)
        self._bin.write(arr.tobytes())
        self._lengths.append(int(arr.size))

    def add_documents(self, data: bytes, lengths: list[int]) -> None:
        """Append several documents already encoded in this writer's dtype, back to back (fast path)."""
        self._bin.write(data)
        self._lengths.extend(lengths)

    @property
    def num_documents(self) -> int:
        return len(self._lengths)

    @property
    def num_tokens(self) -> int:
        return int(sum(self._lengths))

    def finalize(self) -> None:
        self._bin.close()
        idx_tmp = _tmp_path(self.prefix + ".idx")
        write_index(idx_tmp, self.dtype, np.asarray(self._lengths, dtype=np.int64))
        os.replace(self._bin_tmp, self.prefix + ".bin")
        os.replace(idx_tmp, self.prefix + ".idx")

    def abort(self) -> None:
        self._bin.close()
        if os.path.exists(self._bin_tmp):
            os.remove(self._bin_tmp)


def _read_mmidx(idx_path: str, idx_size: int) -> tuple[np.dtype, np.ndarray, np.ndarray]:
    """(dtype, int32 sequence lengths, int64 byte pointers) of an MMIDIDX file, every count checked."""
    with open(idx_path, "rb") as f:
        header = f.read(HEADER.size)
    if len(header) < HEADER.size:
        raise DataError(f"--data-path: {idx_path} is truncated (header incomplete); rerun `ptdp preprocess`")
    _, version, code, n_seq, n_doc = HEADER.unpack(header)
    if version != VERSION:
        raise DataError(f"--data-path: {idx_path} has unsupported index version {version} (expected 1)")
    if code not in DTYPE_CODES:
        raise DataError(f"--data-path: {idx_path} has unknown dtype code {code} (expected 1..8)")
    expected = HEADER.size + 4 * n_seq + 8 * n_seq + 8 * n_doc
    if idx_size != expected:
        raise DataError(
            f"--data-path: {idx_path} is {idx_size} bytes but its counts ({n_seq} sequences, {n_doc} documents) "
            f"need {expected}; rerun `ptdp preprocess`"
        )
    off = HEADER.size
    lengths = np.memmap(idx_path, dtype=np.int32, mode="r", offset=off, shape=(n_seq,)) if n_seq else \
        np.zeros(0, np.int32)
    pointers = np.memmap(idx_path, dtype=np.int64, mode="r", offset=off + 4 * n_seq, shape=(n_seq,)) if n_seq \
        else np.zeros(0, np.int64)
    return DTYPE_CODES[code], lengths, pointers


def _read_legacy(idx_path: str, idx_size: int) -> tuple[np.dtype, np.ndarray, np.ndarray]:
    with open(idx_path, "rb") as f:
        _, version, code, n = LEGACY_HEADER.unpack(f.read(LEGACY_HEADER.size))
    if version != 1 or code not in LEGACY_DTYPES or idx_size != LEGACY_HEADER.size + 8 * (n + 1):
        raise DataError(f"--data-path: {idx_path} is a damaged ptdp (PTDPIDX) index; rerun `ptdp preprocess`")
    dtype = LEGACY_DTYPES[code]
    offsets = np.fromfile(idx_path, dtype=np.int64, offset=LEGACY_HEADER.size, count=n + 1)
    return dtype, np.diff(offsets).astype(np.int32), offsets[:-1] * dtype.itemsize


class IndexedDataset:
    """Read-only view of ``PREFIX.bin/.idx``; the token stream is opened lazily so pickling stays cheap.

    ``sequence_lengths`` (int32) and ``offsets`` (int64, ``n + 1`` token offsets) describe the sequences;
    sequence ``k`` is ``tokens[offsets[k] : offsets[k + 1]]``.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        try:  # .bin first: a wrong prefix is reported as "cannot read PREFIX.bin", the file users know
            bin_size = os.path.getsize(bin_path)
        except OSError as err:
            raise DataError(f"--data-path: cannot read {bin_path} ({err.strerror})") from None
        try:
            idx_size = os.path.getsize(idx_path)
            with open(idx_path, "rb") as f:
                magic = f.read(len(MAGIC))
        except OSError as err:
            raise DataError(f"--data-path: cannot read {idx_path} ({err.strerror})") from None
        if magic == MAGIC:
            self.dtype, lengths, pointers = _read_mmidx(idx_path, idx_size)
        elif magic[: len(LEGACY_MAGIC)] == LEGACY_MAGIC:
            self.dtype, lengths, pointers = _read_legacy(idx_path, idx_size)
        else:
            raise DataError(
                f"--data-path: {idx_path} is not a Megatron MMIDIDX index; rebuild it with `ptdp preprocess`"
            )
        self.sequence_lengths = lengths
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if len(lengths) and (np.any(lengths < 0) or not np.array_equal(pointers, offsets[:-1] * self.dtype.itemsize)):
            raise DataError(
                f"--data-path: {idx_path} has sequence pointers that do not match its lengths (not contiguous)"
            )
        self.offsets = offsets
        if bin_size != int(offsets[-1]) * self.dtype.itemsize:
            raise DataError(
                f"--data-path: {bin_path} is {bin_size} bytes but {idx_path} counts {int(offsets[-1])} tokens of "
                f"{self.dtype.itemsize} bytes; the pair is truncated or mismatched, rerun `ptdp preprocess`"
            )
        self._tokens: np.ndarray | None = None

    @property
    def tokens(self) -> np.ndarray:
        """The whole token stream as a memmap (never copied)."""
        if self._tokens is None:
            n = int(self.offsets[-1])
            # np.memmap rejects empty files; an empty stream is a valid (useless) dataset.
            self._tokens = (
                np.memmap(self.prefix + ".bin", dtype=self.dtype, mode="r", shape=(n,))
                if n
                else np.zeros(0, self.dtype)
            )
        return self._tokens

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_tokens"] = None  # reopen in the child instead of pickling the corpus
        state["sequence_lengths"] = np.asarray(self.sequence_lengths)
        return state

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def document(self, k: int) -> np.ndarray:
        return np.asarray(self.tokens[int(self.offsets[k]) : int(self.offsets[k + 1])])

    def get(self, k: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of sequence ``k`` (Megatron's ``IndexedDataset.get``)."""
        start = int(self.offsets[k]) + offset
        stop = int(self.offsets[k + 1]) if length is None else start + length
        return self.tokens[start:stop]

    def __len__(self) -> int:
        return self.num_documents
