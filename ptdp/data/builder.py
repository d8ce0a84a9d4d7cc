"""``build_datasets``: from ``--data-path`` / ``--split`` / ``--seq-length`` / ``--seed`` to train/valid/test.

``--data-path`` takes Megatron's forms: nothing (the embedded default corpus, see default_corpus.py),
``PREFIX``, ``A B`` (a blend weighted by each dataset's size) or ``0.3 A 0.7 B`` (explicit weights). The
split string ``"969,30,1"`` divides each dataset's *documents* into consecutive train/valid/test ranges,
in proportion, exactly like Megatron's ``get_train_valid_test_split_``; a blend is then built per split.
"""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.data.blended_dataset import BlendedDataset
from ptdp.data.default_corpus import default_corpus_prefix
from ptdp.data.errors import DataError
from ptdp.data.gpt_dataset import GPTDataset
from ptdp.data.indexed_dataset import IndexedDataset
from ptdp.data.tokenizer import Tokenizer, load_tokenizer

SPLIT_NAMES = ("train", "valid", "test")


@dataclass
class DataSplits:
    train: GPTDataset | BlendedDataset
    valid: GPTDataset | BlendedDataset | None
    test: GPTDataset | BlendedDataset | None
    tokenizer: Tokenizer


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` (also ``/``-separated, missing parts = 0) -> three fractions summing to 1."""
    try:
        parts = [float(x) for x in split.replace("/", ",").split(",") if x.strip()]
    except ValueError:
        parts = []
    if not parts or len(parts) > 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise DataError(f"--split: cannot parse {split!r}; give three non-negative proportions like 969,30,1")
    parts += [0.0] * (3 - len(parts))
    return [p / sum(parts) for p in parts]


def split_document_ranges(num_documents: int, fractions: list[float]) -> list[tuple[int, int]]:
    """Consecutive document ranges per split; rounding error is absorbed so the last bound is exact."""
    bounds = [0]
    for frac in fractions:
        bounds.append(bounds[-1] + int(round(frac * num_documents)))
    diff = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    bounds = [min(max(b, 0), num_documents) for b in bounds]
    return [(bounds[k], bounds[k + 1]) for k in range(3)]


def parse_data_path(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """(prefixes, weights); weights None means "by size"."""

    def as_weight(text: str) -> float | None:
        try:
            return float(text)
        except ValueError:
            return None

    if len(data_path) > 1 and as_weight(data_path[0]) is not None:
        weights = [as_weight(x) for x in data_path[0::2]]
        prefixes = data_path[1::2]
        if len(data_path) % 2 or any(w is None or w < 0 for w in weights) or sum(weights) <= 0:
            raise DataError(
                "--data-path: weighted blends are pairs 'WEIGHT PREFIX ...' with non-negative weights"
            )
        return prefixes, weights
    return list(data_path), None


def _strip_suffix(prefix: str) -> str:
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            return prefix[: -len(suffix)]
    return prefix


def build_datasets(data_path: list[str] | None, split: str, seq_length: int, seed: int) -> DataSplits:
    """The train/valid/test splits (rank 0 says so when this takes more than 2 s: a first run tokenizes
    and caches the default corpus, an indexed dataset builds its sample index)."""
    from ..phases import phase

    with phase("building the datasets"):
        return _build_datasets(data_path, split, seq_length, seed)


def _build_datasets(data_path: list[str] | None, split: str, seq_length: int, seed: int) -> DataSplits:
    if seq_length < 1:
        raise DataError(f"--seq-length must be >= 1, got {seq_length}")
    fractions = parse_split(split)
    if data_path:
        prefixes, weights = parse_data_path(data_path)
        prefixes = [_strip_suffix(p) for p in prefixes]
    else:
        prefixes, weights = [default_corpus_prefix()], None

    tokenizers = [load_tokenizer(p) for p in prefixes]
    for prefix, tok in zip(prefixes[1:], tokenizers[1:]):
        if tok.fingerprint != tokenizers[0].fingerprint:
            raise DataError(
                f"--data-path: {prefix} uses a different tokenizer than {prefixes[0]}; blended datasets must "
                "share one vocabulary"
            )

    per_split: list[list[GPTDataset]] = [[], [], []]
    for member, prefix in enumerate(prefixes):
        indexed = IndexedDataset(prefix)
        ranges = split_document_ranges(indexed.num_documents, fractions)
        for split_id, doc_range in enumerate(ranges):
            salt = split_id * 1_000_003 + member  # distinct shuffle per (split, blend member)
            per_split[split_id].append(GPTDataset(indexed, doc_range, seq_length, seed, salt=salt))

    def combine(datasets: list[GPTDataset]) -> GPTDataset | BlendedDataset | None:
        if len(datasets) == 1:
            return datasets[0] if len(datasets[0]) else None
        w = weights if weights is not None else [len(d) for d in datasets]
        kept = [(d, x) for d, x in zip(datasets, w) if len(d) and x > 0]
        if not kept:
            return None
        return BlendedDataset([d for d, _ in kept], [x for _, x in kept])

    train, valid, test = (combine(ds) for ds in per_split)
    if train is None:
        raise DataError(
            f"--data-path: the train split has no sample of {seq_length + 1} tokens; use more data, a smaller "
            "--seq-length, or a larger train share in --split"
        )
    return DataSplits(train=train, valid=valid, test=test, tokenizer=tokenizers[0])
