"""``build_datasets``: from ``--data-path`` / ``--split`` (or ``--train/valid/test-data-path``) / ``--seq-length`` /
``--seed`` to train/valid/test.

``--data-path`` takes Megatron's forms: nothing (the embedded default corpus, see default_corpus.py),
``PREFIX``, ``A B`` (a blend weighted by each dataset's size) or ``0.3 A 0.7 B`` (explicit weights). The
split string ``"969,30,1"`` divides each dataset's *documents* into consecutive train/valid/test ranges,
in proportion, exactly like Megatron's ``get_train_valid_test_split_``; a blend is then built per split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ptdp.data.blended_dataset import BlendedDataset
from ptdp.data.default_corpus import default_corpus_prefix
from ptdp.data.errors import DataError
from ptdp.data.gpt_dataset import GPTDataset
from ptdp.data.indexed_dataset import IndexedDataset
from ptdp.data.sft_dataset import SFTDataset, SFTOptions
from ptdp.data.tokenizer import Tokenizer, load_tokenizer

SPLIT_NAMES = ("train", "valid", "test")
MID_LEVEL_SURPLUS = 0.005  # Megatron's --mid-level-dataset-surplus: members build 0.5% extra samples


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


def member_sizes(weights: list[float], target: int | None, surplus: float = MID_LEVEL_SURPLUS) -> list[int | None]:
    """Samples each blend member must provide for ``target`` blended samples (Megatron's
    ``_get_size_per_split_per_dataset``: ``ceil(ceil(target * w) * (1 + surplus))``)."""
    if target is None:
        return [None] * len(weights)
    total = sum(weights)
    return [int(math.ceil(math.ceil(target * w / total) * (1 + surplus))) for w in weights]


def build_datasets(
    data_path: list[str] | None,
    split: str,
    seq_length: int,
    seed: int,
    num_samples: Sequence[int | None] | None = None,
    cache_path: str | None = None,
    tokenizer: Tokenizer | None = None,
    per_split: Sequence[Sequence[str]] | None = None,
    whole_valid: bool = False,
    sft: bool = False,
    sft_truncate: bool = False,
) -> DataSplits:
    """The three splits. ``num_samples`` (train, valid, test) sizes the datasets as Megatron's
    ``train_valid_test_num_samples`` does (None: one epoch each); ``tokenizer`` (from the tokenizer flags)
    replaces the one recorded beside the data. ``per_split`` (``--train/valid/test-data-path``, Megatron's
    ``blend_per_split``): each split reads all of its own datasets, as ``--data-path`` with the split's
    whole share of ``--split`` would (``"100,0,0"`` for the training split); ``data_path`` and ``split``
    are then unused. ``whole_valid`` (``--full-validation``): the validation split is every sample of its
    datasets once, blended by size. ``sft`` (``--sft``): whole conversations packed with their loss
    masks (``sft_dataset.py``; ``sft_truncate``: ``--sft-truncate``). Rank 0 says so when this takes more than 2 s (a first run tokenizes
    and caches the default corpus, an indexed dataset builds its sample index)."""
    from ptdp.runtime.phases import phase

    with phase("building the datasets"):
        if per_split is not None and any(per_split):
            return _build_per_split(per_split, seq_length, seed, num_samples, cache_path, tokenizer, whole_valid,
                                    (sft, sft_truncate))
        return _build_datasets(data_path, split, seq_length, seed, num_samples, cache_path, tokenizer, whole_valid,
                               (sft, sft_truncate))


def _sources(data_path: Sequence[str]) -> tuple[list[str], list[float] | None]:
    prefixes, weights = parse_data_path(list(data_path))
    return [_strip_suffix(p) for p in prefixes], weights


def _shared_tokenizer(prefixes: list[str], flag: str = "--data-path") -> Tokenizer:
    """The tokenizer saved beside the data, the same for every dataset (one vocabulary)."""
    tokenizers = [load_tokenizer(p) for p in prefixes]
    for prefix, tok in zip(prefixes[1:], tokenizers[1:]):
        if tok.fingerprint != tokenizers[0].fingerprint:
            raise DataError(f"{flag}: {prefix} uses a different tokenizer than {prefixes[0]}; blended datasets "
                            "must share one vocabulary")
    return tokenizers[0]


def _split_dataset(indexed: list[IndexedDataset], weights: list[float] | None, fractions: list[float],
                   split_id: int, target: int | None, seq_length: int, seed: int, cache_path: str | None,
                   whole: bool = False, sft: SFTOptions | None = None) -> GPTDataset | BlendedDataset | None:
    """Split ``split_id`` of the datasets: each one's share of its documents (``fractions``), blended
    (None when no sample fits). ``whole``: one epoch of each, blended by size, whatever the weights."""
    name = SPLIT_NAMES[split_id]
    if whole:
        target, weights = None, None
    if weights is None and len(indexed) == 1:
        weights = [1.0]
    sizes = member_sizes(weights, target) if weights is not None and len(indexed) > 1 else [target] * len(indexed)
    members = []
    for k, data in enumerate(indexed):
        if weights is not None and weights[k] <= 0:
            continue  # a weight of 0 keeps the dataset in the list but reads nothing from it
        doc_range = split_document_ranges(data.num_documents, fractions)[split_id]
        dataset = (SFTDataset(data, doc_range, seq_length, seed, sizes[k], cache_path, name, sft) if sft else
                   GPTDataset(data, doc_range, seq_length, seed, sizes[k], cache_path, name))
        if len(dataset):
            members.append((dataset, weights[k] if weights is not None else len(dataset)))
    if not members:
        return None
    if len(indexed) == 1:
        return members[0][0]
    size = target if weights is not None else None
    return BlendedDataset([d for d, _ in members], [w for _, w in members], size)


def sft_options(sft: tuple[bool, bool], tokenizer: Tokenizer) -> SFTOptions | None:
    """``(--sft, --sft-truncate)`` as the datasets' options: samples are padded with the end-of-document id."""
    return SFTOptions(tokenizer.eod_id, sft[1]) if sft[0] else None


def _no_train_sample(seq_length: int, flag: str) -> DataError:
    return DataError(f"{flag}: the train split has no sample of {seq_length + 1} tokens; use more data, a smaller "
                     "--seq-length" + (", or a larger train share in --split" if flag == "--data-path" else ""))


def _build_datasets(
    data_path: list[str] | None,
    split: str,
    seq_length: int,
    seed: int,
    num_samples: Sequence[int | None] | None,
    cache_path: str | None,
    tokenizer: Tokenizer | None,
    whole_valid: bool = False,
    sft: tuple[bool, bool] = (False, False),
) -> DataSplits:
    if seq_length < 1:
        raise DataError(f"--seq-length must be >= 1, got {seq_length}")
    fractions = parse_split(split)
    targets = list(num_samples) if num_samples is not None else [None, None, None]
    prefixes, weights = _sources(data_path) if data_path else ([default_corpus_prefix()], None)
    tokenizer = tokenizer or _shared_tokenizer(prefixes)
    indexed = [IndexedDataset(prefix) for prefix in prefixes]
    options = sft_options(sft, tokenizer)
    train, valid, test = (_split_dataset(indexed, weights, fractions, k, targets[k], seq_length, seed, cache_path,
                                         whole=whole_valid and k == 1, sft=options) for k in range(3))
    if train is None:
        raise _no_train_sample(seq_length, "--data-path")
    return DataSplits(train=train, valid=valid, test=test, tokenizer=tokenizer)


def _build_per_split(per_split: Sequence[Sequence[str]], seq_length: int, seed: int,
                     num_samples: Sequence[int | None] | None, cache_path: str | None, tokenizer: Tokenizer | None,
                     whole_valid: bool, sft: tuple[bool, bool] = (False, False)) -> DataSplits:
    """Megatron's ``blend_per_split``: split k reads all the documents of its own datasets (the split
    proportions spoofed to 100% for k), under split k's name and size, so ``--train-data-path X`` builds
    exactly ``--data-path X --split 100,0,0``'s training split."""
    if seq_length < 1:
        raise DataError(f"--seq-length must be >= 1, got {seq_length}")
    targets = list(num_samples) if num_samples is not None else [None, None, None]
    sources = [_sources(path) if path else ([], None) for path in per_split]
    tokenizer = tokenizer or _shared_tokenizer([p for prefixes, _ in sources for p in prefixes],
                                               "--train/valid/test-data-path")
    options = sft_options(sft, tokenizer)
    splits: list[GPTDataset | BlendedDataset | None] = []
    for k, (prefixes, weights) in enumerate(sources):
        fractions = [float(k == j) for j in range(3)]
        splits.append(_split_dataset([IndexedDataset(p) for p in prefixes], weights, fractions, k, targets[k],
                                     seq_length, seed, cache_path, whole=whole_valid and k == 1, sft=options)
                      if prefixes else None)
    if splits[0] is None and per_split[0]:
        raise _no_train_sample(seq_length, "--train-data-path")
    return DataSplits(train=splits[0], valid=splits[1], test=splits[2], tokenizer=tokenizer)
