"""Indexed token files: ``PREFIX.bin`` (all token ids back to back) + ``PREFIX.idx`` (document offsets).

The same format serves user data (written by ``ptdp preprocess``) and the default corpus, so there is one
read path. Readers memory-map both files: a rank touches only the pages of the samples it reads, and 8
ranks on one machine share the page cache instead of holding 8 int64 copies of the corpus.

``.idx`` layout (little endian; field by field in docs/data.md)::

    offset 0   8 bytes   magic  b"PTDPIDX\\0"
    offset 8   uint32    format version (1)
    offset 12  uint32    dtype code of .bin (1 = uint16, 2 = int32)
    offset 16  uint64    document count n
    offset 24  int64[n+1] document offsets in tokens; document k is bin[off[k]:off[k+1]], off[n] = total

Writers go through temp files + ``os.replace`` so a concurrent reader sees either no file or a whole one.
"""

from __future__ import annotations

import os
import struct
import uuid

import numpy as np

from ptdp.data.errors import DataError

MAGIC = b"PTDPIDX\x00"
VERSION = 1
HEADER = struct.Struct("<8sIIQ")  # magic, version, dtype code, document count -> 24 bytes
DTYPE_CODES = {1: np.dtype(np.uint16), 2: np.dtype(np.int32)}
CODE_OF_DTYPE = {dt: code for code, dt in DTYPE_CODES.items()}


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 halves disk and page-cache use whenever every id fits (vocab <= 65536), else int32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.int32)


def _tmp_path(path: str) -> str:
    return f"{path}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}"


class IndexedDatasetWriter:
    """Append documents, then :meth:`finalize` publishes ``PREFIX.bin`` and ``PREFIX.idx`` atomically.

    .bin is renamed into place before .idx and readers open .idx first, so a visible .idx always has its
    complete .bin beside it.
    """

    def __init__(self, prefix: str, vocab_size: int) -> None:
        self.prefix = prefix
        self.dtype = dtype_for_vocab(vocab_size)
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
        offsets = np.zeros(len(self._lengths) + 1, dtype=np.int64)
        np.cumsum(np.asarray(self._lengths, dtype=np.int64), out=offsets[1:])
        idx_tmp = _tmp_path(self.prefix + ".idx")
        with open(idx_tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[self.dtype], len(self._lengths)))
            f.write(offsets.tobytes())
        os.replace(self._bin_tmp, self.prefix + ".bin")
        os.replace(idx_tmp, self.prefix + ".idx")

    def abort(self) -> None:
        self._bin.close()
        if os.path.exists(self._bin_tmp):
            os.remove(self._bin_tmp)


class IndexedDataset:
    """Read-only view of ``PREFIX.bin/.idx``; opened lazily so pickling (DataLoader workers) stays cheap."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        try:  # .bin first: a wrong prefix is reported as "cannot read PREFIX.bin", the file users know
            bin_size = os.path.getsize(bin_path)
        except OSError as err:
            raise DataError(f"--data-path: cannot read {bin_path} ({err.strerror})") from None
        try:
            with open(idx_path, "rb") as f:
                header = f.read(HEADER.size)
        except OSError as err:
            raise DataError(f"--data-path: cannot read {idx_path} ({err.strerror})") from None
        if len(header) < HEADER.size or header[:8] != MAGIC:
            raise DataError(
                f"--data-path: {idx_path} is not a ptdp index file; rebuild it with `ptdp preprocess`"
            )
        _, version, code, n_docs = HEADER.unpack(header)
        if version != VERSION or code not in DTYPE_CODES:
            raise DataError(f"--data-path: {idx_path} has unsupported version {version} / dtype code {code}")
        self.dtype = DTYPE_CODES[code]
        self.offsets = np.memmap(idx_path, dtype=np.int64, mode="r", offset=HEADER.size, shape=(n_docs + 1,))
        if bin_size != int(self.offsets[-1]) * self.dtype.itemsize:
            raise DataError(
                f"--data-path: {bin_path} size does not match {idx_path}; rerun `ptdp preprocess`"
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
        state["offsets"] = np.asarray(self.offsets)
        return state

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def document(self, k: int) -> np.ndarray:
        return np.asarray(self.tokens[int(self.offsets[k]) : int(self.offsets[k + 1])])

    def __len__(self) -> int:
        return self.num_documents
