"""The on-disk layout of checkpoints and the file operations that make saves atomic and verifiable.

No torch here: the start-up checks (``validation``) use this module in the launcher and on every rank
before any process group exists. Layout (see docs/checkpoints.md)::

    DIR/latest                    the iteration of the newest *complete* checkpoint, e.g. "6"
    DIR/iter_0000006/.metadata    DCP's index of the shards (global shapes, chunk offsets)
    DIR/iter_0000006/__0_0.distcp DCP's data files, one per writing rank
    DIR/iter_0000006/ptdp.json    iteration, model config, layout it was saved in, what it contains
    DIR/iter_0000006/checksums.sha256   sha256 of every other file (``sha256sum -c`` format)

A save writes ``DIR/.tmp-iter_0000006`` and renames it into place only once every file and its checksum
are on disk; ``latest`` is replaced (write, fsync, ``os.replace``) only after that rename, and old
checkpoints are pruned only after ``latest`` moved. A crash at any point leaves ``latest`` naming a
complete checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from ..config import ConfigError

FORMAT = "ptdp-dcp/1"
LATEST = "latest"
INFO = "ptdp.json"
CHECKSUMS = "checksums.sha256"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")


class CheckpointError(ConfigError):
    """A missing, corrupted or mismatched checkpoint: one line naming the file/flag and the fix."""


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def temporary_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f".tmp-iter_{iteration:07d}"


def read_latest(root: str | Path) -> int | None:
    """The iteration ``DIR/latest`` names, or None when there is no ``latest`` (nothing saved yet)."""
    path = Path(root) / LATEST
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"--load: cannot read {path}: {e.strerror}") from None
    if not text.isdigit():
        raise CheckpointError(f"--load: {path} should hold an iteration number, found {text[:40]!r}; "
                              "write the iteration of a complete iter_* checkpoint into it")
    return int(text)


def resolve(path: str | Path) -> Path | None:
    """The checkpoint directory that ``--load PATH`` means: PATH itself if it is one, else DIR/latest's."""
    path = Path(path)
    if (path / INFO).exists() or (path / CHECKSUMS).exists():
        return path
    iteration = read_latest(path)
    if iteration is None:
        return None
    directory = iteration_dir(path, iteration)
    if not directory.is_dir():
        raise CheckpointError(f"--load: {path / LATEST} names iteration {iteration} but {directory} does not "
                              "exist; point it at an existing iter_* directory")
    return directory


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checksums(directory: Path) -> None:
    """Record the sha256 of every file in ``directory`` (written last, so its presence means complete)."""
    lines = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != CHECKSUMS):
        _fsync(path)
        lines.append(f"{sha256_file(path)}  {path.relative_to(directory).as_posix()}\n")
    target = directory / CHECKSUMS
    target.write_text("".join(lines))
    _fsync(target)


_VERIFIED: dict[tuple[str, str], bool] = {}


def verify_checksums(directory: Path) -> None:
    """Raise :class:`CheckpointError` naming the first missing, truncated or corrupted file.

    Each process verifies a checkpoint once (the start-up check and the load share the result), so a
    bad file is found on every rank before any collective and no rank waits for another.
    """
    manifest = directory / CHECKSUMS
    try:
        text = manifest.read_text()
    except FileNotFoundError:
        raise CheckpointError(f"--load: {directory} has no {CHECKSUMS}, so it is not a complete ptdp "
                              "checkpoint; point --load at a directory saved by ptdp") from None
    except OSError as e:
        raise CheckpointError(f"--load: cannot read {manifest}: {e.strerror}") from None
    key = (str(directory.resolve()), hashlib.sha256(text.encode()).hexdigest())
    if key in _VERIFIED:
        return
    for number, line in enumerate(text.splitlines(), 1):
        digest, _, name = line.partition("  ")
        if len(digest) != 64 or not name or ".." in Path(name).parts:
            raise CheckpointError(f"--load: {manifest} line {number} is malformed; the checkpoint is corrupted")
        path = directory / name
        try:
            actual = sha256_file(path)
        except FileNotFoundError:
            raise CheckpointError(f"--load: checkpoint file {path} is missing; restore it or point "
                                  f"{directory.parent / LATEST} at an older checkpoint") from None
        except OSError as e:
            raise CheckpointError(f"--load: cannot read checkpoint file {path}: {e.strerror}") from None
        if actual != digest:
            raise CheckpointError(f"--load: checkpoint file {path} is corrupted or truncated (sha256 mismatch); "
                                  f"restore it or point {directory.parent / LATEST} at an older checkpoint")
    _VERIFIED[key] = True


def read_info(directory: Path) -> dict:
    """``ptdp.json`` of a checkpoint (checked by :func:`verify_checksums` first)."""
    path = directory / INFO
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"--load: cannot read {path}: {e}; the checkpoint is incomplete") from None
    if info.get("format") != FORMAT:
        raise CheckpointError(f"--load: {path} has format {info.get('format')!r}, expected {FORMAT!r}")
    return info


def write_info(directory: Path, info: dict) -> None:
    (directory / INFO).write_text(json.dumps({"format": FORMAT, **info}, indent=1, sort_keys=True) + "\n")


def prepare_temporary(root: str | Path, iteration: int) -> Path:
    """An empty temporary directory for a save (a leftover from a crashed save is discarded)."""
    tmp = temporary_dir(root, iteration)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(root: str | Path, iteration: int, keep_last: int | None = None) -> Path:
    """Checksum the temporary directory, rename it into place, then move ``latest``, then prune."""
    root = Path(root)
    tmp, final = temporary_dir(root, iteration), iteration_dir(root, iteration)
    write_checksums(tmp)
    if final.exists():  # a complete save of this iteration from an earlier attempt; latest is not on it
        trash = root / f".trash-{final.name}"
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(final, trash)
        shutil.rmtree(trash)
    os.rename(tmp, final)
    _fsync(root)
    latest_tmp = root / f".{LATEST}.tmp"
    latest_tmp.write_text(f"{iteration}\n")
    _fsync(latest_tmp)
    os.replace(latest_tmp, root / LATEST)
    _fsync(root)
    if keep_last:
        prune(root, keep_last)
    return final


def saved_iterations(root: str | Path) -> list[int]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _ITER_DIR.match(p.name)) and p.is_dir())


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` checkpoints; never the one ``latest`` names."""
    latest = read_latest(root)
    for iteration in saved_iterations(root)[:-keep_last]:
        if iteration != latest:
            shutil.rmtree(iteration_dir(root, iteration), ignore_errors=True)
