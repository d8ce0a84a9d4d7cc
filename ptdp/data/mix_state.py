"""The data state a checkpoint records, so a resumed run can change its data mix without repeating or
skipping a sample (docs/data.md, "Changing the data mix").

``ptdp.json`` holds, under ``"data"``::

    {"consumed_samples": C, "iteration": I, "global_batch_size": B,
     "batch_start": {"iteration": I0, "sample": C0},   # where the current --global-batch-size began
     "blend": {"start_sample": S, "size": N},          # where the current blend began, its index length
     "datasets": [{"prefix", "idx_bytes", "bin_bytes", "idx_sha256",  # identity of PREFIX.idx/.bin
                   "weight", "num_samples",            # normalized weight; the size its order was built for
                   "start", "consumed", "removed"}]}   # its samples read before S, and before C

A dataset's samples are counted in its *own* order (Megatron's GPTDataset order over its train split), so
"consumed 64" means its samples 0..63 were read and sample 64 is next. This module is pure (no torch): the
start-up checks (``checkpointing.validation``) run it in the launcher before any worker starts.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ptdp.data.errors import DataError

_IDENTITIES: dict[tuple[str, int, int, int], dict] = {}


def dataset_identity(prefix: str) -> dict:
    """``{"idx_bytes", "bin_bytes", "idx_sha256"}`` of ``prefix``: the sizes of both files and a hash of the
    ``.idx`` (sequence lengths, pointers and document boundaries: a re-tokenized or re-shuffled corpus changes
    it). Cached per process by (path, sizes, mtime), so a run hashes each ``.idx`` once."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    try:
        stat_idx, bin_bytes = os.stat(idx), os.path.getsize(bin_)
    except OSError as e:
        raise DataError(f"--data-path: cannot read {e.filename} ({e.strerror})") from None
    key = (os.path.abspath(prefix), stat_idx.st_size, bin_bytes, stat_idx.st_mtime_ns)
    if key not in _IDENTITIES:
        digest = hashlib.sha256()
        with open(idx, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        _IDENTITIES[key] = {"idx_bytes": stat_idx.st_size, "bin_bytes": bin_bytes, "idx_sha256": digest.hexdigest()}
    return dict(_IDENTITIES[key])


@dataclass
class MemberState:
    """One dataset of the run's blend, as the checkpoint records it (see the module docstring)."""

    prefix: str  # absolute path without .bin/.idx
    weight: float  # normalized over the blend; 0: kept in the list, nothing read from it
    num_samples: int | None  # the sample count its order was built for (None: never built)
    start: int = 0  # its samples read before the current blend began
    consumed: int = 0  # its samples read so far
    removed: bool = False  # dropped from --data-path: kept here so that re-adding it continues it
    idx_bytes: int | None = None
    bin_bytes: int | None = None
    idx_sha256: str | None = None

    @classmethod
    def from_record(cls, record: dict) -> MemberState:
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in record.items() if k in names})

    def to_record(self) -> dict:
        return asdict(self)

    def identity(self) -> dict:
        return {"idx_bytes": self.idx_bytes, "bin_bytes": self.bin_bytes, "idx_sha256": self.idx_sha256}


@dataclass
class DataState:
    """The parsed ``"data"`` entry of a checkpoint's ``ptdp.json``."""

    consumed_samples: int
    iteration: int
    global_batch_size: int
    batch_start: tuple[int, int]  # (iteration, sample) where the current global batch size began
    blend_start: int  # global sample where the current blend began
    blend_size: int  # length of the current blend's index (it wraps after that)
    members: list[MemberState]

    @classmethod
    def from_info(cls, info: dict) -> DataState | None:
        """None for checkpoints written before the data state existed (they resume as before)."""
        data = info.get("data")
        if not data:
            return None
        return cls(int(data["consumed_samples"]), int(data["iteration"]), int(data["global_batch_size"]),
                   (int(data["batch_start"]["iteration"]), int(data["batch_start"]["sample"])),
                   int(data["blend"]["start_sample"]), int(data["blend"]["size"]),
                   [MemberState.from_record(m) for m in data["datasets"]])

    def to_info(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "iteration": self.iteration,
                "global_batch_size": self.global_batch_size,
                "batch_start": {"iteration": self.batch_start[0], "sample": self.batch_start[1]},
                "blend": {"start_sample": self.blend_start, "size": self.blend_size},
                "datasets": [m.to_record() for m in self.members]}


def normalized(weights: Sequence[float]) -> list[float]:
    total = float(sum(weights))
    return [float(w) / total for w in weights]


def changed_identities(state: DataState, prefixes: Sequence[str]) -> list[str]:
    """The prefixes of ``prefixes`` (absolute) that the checkpoint read under another identity."""
    recorded = {m.prefix: m for m in state.members}
    out = []
    for prefix in prefixes:
        member = recorded.get(prefix)
        if member is None or member.idx_sha256 is None:
            continue
        now = dataset_identity(prefix)
        if now != member.identity():
            out.append(prefix)
    return out


def identity_error(directory: str, prefix: str) -> str:
    """The one line for a dataset whose files changed under the same prefix."""
    return (f"--data-path: dataset {prefix} is not the one the checkpoint at {directory} read (its .idx/.bin "
            "size or .idx hash changed); restore the original files, or pass --override-data-state to start "
            "this dataset over from its first sample")


def current_prefixes(data_path: Sequence[str]) -> list[str]:
    """Absolute prefixes of ``--data-path`` (the default corpus when empty), as the data state names them."""
    from ptdp.data.builder import _strip_suffix, parse_data_path
    from ptdp.data.default_corpus import default_corpus_prefix

    if not data_path:
        return [os.path.abspath(default_corpus_prefix())]
    return [os.path.abspath(_strip_suffix(p)) for p in parse_data_path(list(data_path))[0]]


def data_state_errors(data_path: Sequence[str], override: bool, info: dict, directory: str) -> list[str]:
    """Start-up check of ``--load`` against ``--data-path``: one line per dataset whose identity changed
    (none with ``--override-data-state``), or the ``--data-path`` problem itself. Pure, no torch."""
    state = DataState.from_info(info)
    try:
        prefixes = current_prefixes(data_path)
        if state is None or override:
            return []
        return [identity_error(directory, p) for p in changed_identities(state, prefixes)]
    except DataError as e:
        return [str(e)]


def epoch_remaining(consumed: int, tokens_per_epoch: int, seq_length: int) -> tuple[int, int] | None:
    """(epoch number from 1, samples left in it) after ``consumed`` samples of a dataset whose epoch holds
    ``tokens_per_epoch`` tokens: epoch ``e`` ends after Megatron's ``(e*T - 1) // s`` samples."""
    if tokens_per_epoch <= 1:
        return None
    epoch = consumed * seq_length // tokens_per_epoch + 1
    while (epoch * tokens_per_epoch - 1) // seq_length <= consumed:
        epoch += 1
    return epoch, (epoch * tokens_per_epoch - 1) // seq_length - consumed
