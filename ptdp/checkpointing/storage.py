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
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ptdp.config import ConfigError

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


def checkpoint_files(directory: Path) -> list[Path]:
    """Every file of a (temporary) checkpoint directory but the manifest, in a fixed order."""
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != CHECKSUMS)


def fsync_and_hash(directory: Path, part: int = 0, parts: int = 1) -> list[str]:
    """Make this rank's share (every ``parts``-th file from ``part``) of the directory's files durable and
    return their manifest lines: hashing is split across ranks instead of one rank reading everything."""
    lines = []
    for path in checkpoint_files(directory)[part::parts]:
        _fsync(path)
        lines.append(f"{sha256_file(path)}  {path.relative_to(directory).as_posix()}\n")
    return lines


def write_checksums(directory: Path, lines: list[str] | None = None) -> None:
    """Write the manifest (the lines of every rank's share, or of all files when not given) and fsync it;
    it is written last, so its presence means the files it names were durable first."""
    lines = fsync_and_hash(directory) if lines is None else lines
    target = directory / CHECKSUMS
    with target.open("w") as fh:
        fh.write("".join(sorted(lines, key=lambda line: line.split("  ", 1)[1])))
        fh.flush()
        os.fsync(fh.fileno())


_VERIFIED: dict[tuple[str, str], bool] = {}
_DATA_SUFFIX = ".distcp"  # DCP's data files: the bulk, whose hashing is split across ranks


VERIFIED_ENV = "PTDP_VERIFIED_CHECKPOINT"  # set by the launcher for its workers: "<resolved dir> <manifest sha256>"


def verify_checksums(directory: Path, hash_data: bool = True) -> None:
    """Raise :class:`CheckpointError` naming the first missing, truncated or corrupted file.

    Each process verifies a checkpoint once (the start-up check and the load share the result), so a
    bad file is found on every rank before any collective and no rank waits for another. With
    ``hash_data=False`` the data files are only checked to exist (the ranks of a job hash them in shares
    later, :func:`data_file_problem`); the small files are always hashed. Files are hashed by a few threads
    at once (hashlib and file reads release the GIL): the launcher hashes a whole checkpoint this way
    before any worker starts, and tells them (:func:`verified_token`).
    """
    entries = _manifest(directory)
    for _, path, _ in entries:
        if not hash_data and path.name.endswith(_DATA_SUFFIX) and not path.is_file():
            raise CheckpointError(f"--load: checkpoint file {path} is missing; restore it or point "
                                  f"{directory.parent / LATEST} at an older checkpoint")
    todo = [(path, digest) for _, path, digest in entries if hash_data or not path.name.endswith(_DATA_SUFFIX)]
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        problems = list(pool.map(lambda entry: _file_problem(directory, *entry), todo))
    problem = next((p for p in problems if p), None)
    if problem:
        raise CheckpointError(problem)
    if hash_data:
        _VERIFIED[_key(directory)] = True


def verified_token(directory: Path) -> str | None:
    """What the launcher passes in ``PTDP_VERIFIED_CHECKPOINT`` once it hashed ``directory`` whole."""
    key = _key(directory)
    return f"{key[0]} {key[1]}" if key in _VERIFIED else None


def data_file_problem(directory: Path, part: int, parts: int) -> tuple[int, str] | None:
    """The first bad data file of share ``part`` of ``parts`` as (manifest line, message), or None."""
    if _key(directory) in _VERIFIED or os.environ.get(VERIFIED_ENV) == " ".join(_key(directory)):
        return None
    data = [entry for entry in _manifest(directory) if entry[1].name.endswith(_DATA_SUFFIX)]
    for number, path, digest in data[part::parts]:
        problem = _file_problem(directory, path, digest)
        if problem:
            return number, problem
    return None


def _key(directory: Path) -> tuple[str, str]:
    try:
        text = (directory / CHECKSUMS).read_bytes()
    except OSError:
        text = b""
    return str(directory.resolve()), hashlib.sha256(text).hexdigest()


def _file_problem(directory: Path, path: Path, digest: str) -> str | None:
    try:
        actual = sha256_file(path)
    except FileNotFoundError:
        return (f"--load: checkpoint file {path} is missing; restore it or point "
                f"{directory.parent / LATEST} at an older checkpoint")
    except OSError as e:
        return f"--load: cannot read checkpoint file {path}: {e.strerror}"
    if actual != digest:
        return (f"--load: checkpoint file {path} is corrupted or truncated (sha256 mismatch); "
                f"restore it or point {directory.parent / LATEST} at an older checkpoint")
    return None


def _manifest(directory: Path) -> list[tuple[int, Path, str]]:
    """(line number, file, sha256) of every line of the manifest; a malformed manifest raises."""
    manifest = directory / CHECKSUMS
    try:
        text = manifest.read_text()
    except FileNotFoundError:
        raise CheckpointError(f"--load: {directory} has no {CHECKSUMS}, so it is not a complete ptdp "
                              "checkpoint; point --load at a directory saved by ptdp") from None
    except OSError as e:
        raise CheckpointError(f"--load: cannot read {manifest}: {e.strerror}") from None
    if _key(directory) in _VERIFIED:
        return []
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        digest, _, name = line.partition("  ")
        if len(digest) != 64 or not name or ".." in Path(name).parts:
            raise CheckpointError(f"--load: {manifest} line {number} is malformed; the checkpoint is corrupted")
        entries.append((number, directory / name, digest))
    return entries


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


def latest_info(load: str | Path | None) -> tuple[dict | None, str | None]:
    """``ptdp.json`` of ``--load``'s newest checkpoint and its directory; (None, None) without ``--load`` or
    before the first save. What the data pipeline resumes from (``ptdp.data.training_data``), handed down to
    it: the data package reads no checkpoint file itself."""
    if not load:
        return None, None
    directory = resolve(load)
    if directory is None:
        return None, None
    return read_info(directory), str(directory)


def write_info(directory: Path, info: dict) -> None:
    (directory / INFO).write_text(json.dumps({"format": FORMAT, **info}, indent=1, sort_keys=True) + "\n")


def prepare_temporary(root: str | Path, iteration: int) -> Path:
    """An empty temporary directory for a save (a leftover from a crashed save is discarded)."""
    tmp = temporary_dir(root, iteration)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(root: str | Path, iteration: int, keep_last: int | None = None, lines: list[str] | None = None,
           ours: Collection[int] = ()) -> Path:
    """Write the manifest (``lines``: every rank's fsynced share; all files hashed here when None), rename
    the temporary directory into place, then move ``latest``, then prune (``--keep-last``) among ``ours``,
    the iterations this run may delete, and the one just written (:func:`prune`)."""
    root = Path(root)
    tmp, final = temporary_dir(root, iteration), iteration_dir(root, iteration)
    write_checksums(tmp, lines)
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
        prune(root, keep_last, {*ours, iteration})
    return final


def saved_iterations(root: str | Path) -> list[int]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _ITER_DIR.match(p.name)) and p.is_dir())


def continues(load: str | Path | None, save: str | Path | None) -> bool:
    """Whether ``--load`` continues the run that wrote ``--save``: the checkpoint it loads (``DIR/latest``'s,
    or the ``iter_*`` directory it names) lies in the ``--save`` directory."""
    if not load or not save:
        return False
    load = Path(load)
    if _ITER_DIR.match(load.name):
        root = load.parent
    else:
        directory = resolve(load)
        root = load if directory is None else directory.parent
    return root.resolve() == Path(save).resolve()


def prune(root: Path, keep_last: int, ours: Collection[int]) -> None:
    """Delete all but the newest ``keep_last`` of ``ours``, the checkpoints this run owns (those it wrote and
    those of the run it continued: ``CheckpointManager.owned``); never the one ``latest`` names, and never a
    checkpoint of another run that shares the directory (they neither count towards ``keep_last`` nor go)."""
    latest = read_latest(root)
    mine = [iteration for iteration in saved_iterations(root) if iteration in ours]
    for iteration in mine[:-keep_last]:
        if iteration != latest:
            shutil.rmtree(iteration_dir(root, iteration), ignore_errors=True)


def remove_leftovers(root: str | Path) -> list[Path]:
    """Remove what a save cut short leaves in ``root`` (``.tmp-iter_*``, ``.trash-iter_*``, ``.latest.tmp``)
    and return the removed paths. Only rank 0 calls it, at start-up, before any save of this run; ``latest``
    and the ``iter_*`` directories are never touched, so the previous checkpoint stays the one loaded."""
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for path in sorted(root.iterdir()):
        if path.name.startswith((".tmp-iter_", ".trash-iter_")) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        elif path.name == f".{LATEST}.tmp":
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
