"""The default corpus: this Python's own standard-library ``.py`` sources, byte-tokenized.

Every machine that can run ptdp has it, it is ~11 MB of varied real text, and needs no download. It is
prepared once through the ordinary indexed-file writer into ``$PTDP_CACHE_DIR`` (default
``~/.cache/ptdp``), keyed by Python version and a hash of the file list and sizes, so a changed stdlib
gets a fresh file. The writer publishes with ``os.replace``: if 8 ranks start at once and all find the
cache missing, each builds and renames a complete copy, and no rank can read a half-written one.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig

import numpy as np

from ptdp.data.indexed_dataset import IndexedDatasetWriter
from ptdp.data.tokenizer import ByteTokenizer

EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
FORMAT_TAG = "v1"  # bump when the corpus recipe changes


def stdlib_sources(root: str | None = None) -> tuple[str, list[str]]:
    """(root, sorted relative paths of the stdlib ``.py`` files); sorting makes order independent of os.walk."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                found.append(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
    return root, sorted(found)


def cache_dir() -> str:
    return os.environ.get("PTDP_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ptdp")


# The corpus's file name per stdlib root, worked out once per process: the name hashes the list and sizes of
# ~1,300 files (a walk and a stat each, ~12 ms), and a run asks for it at every dataset build.
_NAMES: dict[str, str] = {}


def corpus_name() -> str:
    """``stdlib-<python version>-<hash of the file list and sizes>``: the cached corpus's file name."""
    root = sysconfig.get_paths()["stdlib"]
    if root not in _NAMES:
        _, files = stdlib_sources(root)
        digest = hashlib.sha256(FORMAT_TAG.encode())
        for rel in files:
            digest.update(f"{rel}\0{os.path.getsize(os.path.join(root, rel))}\n".encode())
        version = f"py{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
        _NAMES[root] = f"stdlib-{version}-{digest.hexdigest()[:12]}"
    return _NAMES[root]


def default_corpus_prefix(directory: str | None = None) -> str:
    """Build the default corpus if it is not cached yet; return its ``PREFIX`` (no suffix)."""
    prefix = os.path.join(directory or cache_dir(), corpus_name())
    if os.path.exists(prefix + ".idx") and os.path.exists(prefix + ".bin"):
        return prefix
    root, files = stdlib_sources()
    tokenizer = ByteTokenizer()
    writer = IndexedDatasetWriter(prefix, tokenizer.vocab_size)
    try:
        for rel in files:
            with open(os.path.join(root, rel), "rb") as f:
                text = f.read().decode("utf-8", errors="replace")
            ids = np.frombuffer(tokenizer.encode_bytes(text), dtype=np.uint8).astype(writer.dtype)
            writer.add_document(np.append(ids, np.array([tokenizer.eod_id], dtype=writer.dtype)))
        writer.finalize()
    except BaseException:
        writer.abort()
        raise
    return prefix
