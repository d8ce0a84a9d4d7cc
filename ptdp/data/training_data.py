"""The datasets a run reads, from its config: the one function ``ptdp train`` and ``ptdp samples`` share.

Sizes follow Megatron's ``train_valid_test_num_samples``: ``train_iters * B`` training samples,
``(train_iters // eval_interval + 1) * eval_iters * B`` validation samples (eval_interval defaulting to
Megatron's 1000) and ``eval_iters * B`` test samples; they fix the number of epochs and so the sample order,
exactly as in Megatron, so the same flags give the same batches in both.

With ``--load``, the checkpoint's data state (``mix_state.py``) decides where the train split goes on: the
same blend continues exactly; a changed one starts a new blend at the checkpoint's consumed samples in which
every dataset continues from its first unread sample (``train_stream.py``). The caller hands that record
down (``ptdp.checkpointing.storage.latest_info``): data sits below checkpointing, which saves and verifies the
data state along with the model, so nothing here reads a checkpoint's files.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from ptdp.data.blended_dataset import BlendedDataset
from ptdp.data.builder import DataSplits, build_datasets, parse_data_path, parse_split, split_document_ranges
from ptdp.data.errors import DataError
from ptdp.data.gpt_dataset import GPTDataset
from ptdp.data.indexed_dataset import IndexedDataset
from ptdp.data.mix_state import (
    DataState,
    MemberState,
    changed_identities,
    current_prefixes,
    identity_error,
    normalized,
)
from ptdp.data.sft_dataset import SFTDataset, SFTOptions
from ptdp.data.tokenizer import load_tokenizer
from ptdp.data.tokenizer_flags import build_tokenizer
from ptdp.data.train_stream import TrainStream, new_blend_sizes, summary

if TYPE_CHECKING:
    from ptdp.config import Config

MEGATRON_DEFAULT_EVAL_INTERVAL = 1000
WEIGHT_TOLERANCE = 1e-9  # normalized weights closer than this are the same blend


def train_valid_test_num_samples(config: Config) -> tuple[int, int | None, int]:
    """(train, valid, test) samples; valid None (one epoch, the whole split) with ``--full-validation``."""
    tr = config.training
    eval_interval = tr.eval_interval or MEGATRON_DEFAULT_EVAL_INTERVAL
    batch = tr.global_batch_size
    valid = None if tr.full_validation else (tr.train_iters // eval_interval + 1) * tr.eval_iters * batch
    return tr.train_iters * batch, valid, tr.eval_iters * batch


def model_vocab_size(config: Config) -> int | None:
    """The vocabulary the model gets: ``--vocab-size``, else the tokenizer's (the flags', else the one saved
    beside the first training dataset); None where that tokenizer cannot be read here (the run reports why)."""
    if config.model.vocab_size:  # Megatron's NullTokenizer: N ids and the end of document after them
        return config.model.vocab_size + (config.data.tokenizer_type == "NullTokenizer")
    from ptdp.data.builder import _strip_suffix
    from ptdp.data.default_corpus import default_corpus_prefix

    d = config.data
    try:
        tokenizer = build_tokenizer(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file)
        if tokenizer is None:
            prefixes = parse_data_path(train_data(config)[0])[0] if train_data(config)[0] else []
            tokenizer = load_tokenizer(_strip_suffix(prefixes[0]) if prefixes else default_corpus_prefix())
    except Exception:  # noqa: BLE001 - the data checks name the problem
        return None
    return tokenizer.vocab_size


def train_data(config: Config) -> tuple[list[str], str]:
    """The training split's ``--data-path`` and ``--split``: ``--train-data-path``'s datasets whole
    (``"100,0,0"``, which builds the same samples), or ``--data-path`` divided by ``--split``."""
    d = config.data
    return (list(d.train_data_path), "100,0,0") if d.train_data_path else (list(d.data_path), d.split)


def evaluation_iters(config: Config, dataset) -> int:
    """Global batches per evaluation of ``dataset``: ``--eval-iters``, or with ``--full-validation`` every
    whole global batch of the validation split (the last n mod B samples are left out, as Megatron's
    sampler drops an incomplete batch)."""
    tr = config.training
    return len(dataset) // tr.global_batch_size if tr.full_validation else tr.eval_iters


def datasets_for_config(config: Config, saved: dict | None = None, directory: str | None = None) -> DataSplits:
    """train/valid/test of ``config`` (raises :class:`DataError` with one line on bad input); ``train`` is a
    :class:`TrainStream` that continues the data state of the checkpoint record ``saved`` (``ptdp.json`` of
    ``--load``'s checkpoint, read from ``directory``), if it has one."""
    d, tr = config.data, config.training
    tokenizer = build_tokenizer(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file,
                                config.model.vocab_size)
    splits = build_datasets(d.data_path or None, d.split, config.model.seq_length, tr.seed,
                            num_samples=train_valid_test_num_samples(config), cache_path=d.data_cache_path,
                            tokenizer=tokenizer, per_split=[d.train_data_path, d.valid_data_path, d.test_data_path],
                            whole_valid=tr.full_validation, sft=d.sft, sft_truncate=d.sft_truncate)
    if tr.full_validation and splits.valid is not None and len(splits.valid) < tr.global_batch_size:
        raise DataError(f"--full-validation: the validation split holds {len(splits.valid)} samples, fewer than one "
                        f"global batch (--global-batch-size {tr.global_batch_size})")
    check_end_of_documents(config, splits)
    state = DataState.from_info(saved) if saved is not None else None
    splits.train = train_stream(config, splits.train, state, directory)
    return splits


EOD_SCAN_TOKENS = 1 << 22  # how far into each dataset the document flags look for an end of document


def check_end_of_documents(config: Config, splits: DataSplits) -> None:
    """The document flags (``--reset-position-ids``, ``--reset-attention-mask``, ``--eod-mask-loss``) find
    documents by their end-of-document token: a training dataset without one in its first
    ``EOD_SCAN_TOKENS`` tokens is one line of :class:`DataError` (exit 2) instead of a run in which every
    sample is one document."""
    d = config.data
    if d.sft:  # conversations are told apart by the index, not by an end-of-document token
        return
    flags = [flag for flag, on in (("--reset-position-ids", d.reset_position_ids),
                                   ("--reset-attention-mask", d.reset_attention_mask),
                                   ("--eod-mask-loss", d.eod_mask_loss)) if on]
    if not flags:
        return
    eod = splits.tokenizer.eod_id
    for prefix, member in _built_members(splits.train).items():
        head = np.asarray(member.indexed.tokens[:EOD_SCAN_TOKENS])
        if len(head) and not np.any(head == eod):
            raise DataError(f"{' '.join(flags)}: {prefix} has no end-of-document token (id {eod}) in its first "
                            f"{len(head)} tokens, so its documents cannot be told apart; write the dataset with "
                            "`ptdp preprocess` (which ends every document with it) or leave the flag out")


def _built_members(train: GPTDataset | BlendedDataset) -> dict[str, GPTDataset]:
    members = train.datasets if isinstance(train, BlendedDataset) else [train]
    return {os.path.abspath(m.indexed.prefix): m for m in members}


def train_stream(config: Config, built, state: DataState | None, directory: str | None) -> TrainStream:
    """The train split as training reads it (``built``: the builder's train dataset for these flags)."""
    tr = config.training
    data_path = train_data(config)[0]
    prefixes = current_prefixes(data_path)
    if len(set(prefixes)) != len(prefixes):
        twice = next(p for p in prefixes if prefixes.count(p) > 1)
        flag = "--train-data-path" if config.data.train_data_path else "--data-path"
        raise DataError(f"{flag} names {twice} twice; give each dataset once (with the summed weight)")
    given = parse_data_path(data_path)[1] if data_path else None
    datasets = _built_members(built)
    if given is None:  # one dataset, or a blend weighted by the datasets' sizes
        given = [float(len(datasets[p])) if p in datasets else 0.0 for p in prefixes]
    weights = normalized(given)
    raw = [given[i] for i, p in enumerate(prefixes) if p in datasets and given[i] > 0]
    if state is None:  # a fresh start, or a checkpoint from before the data state: the builder's order
        members = [MemberState(p, w, datasets[p].num_samples if p in datasets else None)
                   for p, w in zip(prefixes, weights, strict=True)]
        return TrainStream(members, [datasets.get(p) for p in prefixes], 0, len(built), (0, 0),
                           tr.global_batch_size, raw, blend=built)
    overridden = changed_identities(state, prefixes)
    if overridden and not config.data.override_data_state:
        raise DataError(identity_error(directory, overridden[0]))
    recorded = {m.prefix: m for m in state.members}
    batch_start = (state.batch_start if tr.global_batch_size == state.global_batch_size
                   else (state.iteration, state.consumed_samples))
    before = [(m.prefix, m.weight) for m in state.members if not m.removed]
    unchanged = not overridden and len(before) == len(prefixes) and all(
        p == q and abs(v - w) <= WEIGHT_TOLERANCE for (p, v), q, w in zip(before, prefixes, weights))
    if unchanged:
        members = [MemberState(**{**recorded[p].to_record(), "weight": recorded[p].weight}) for p in prefixes]
        members += [m for m in state.members if m.removed]
        sets = [_dataset(config, m.prefix, m.num_samples, datasets) if m.weight > 0 and not m.removed else None
                for m in members]
        reuse = built if state.blend_start == 0 and all(s is datasets.get(m.prefix) for m, s in
                                                         zip(members, sets) if s is not None) else None
        # From S = 0 the builder's weights as given (the fresh run's floats); a later blend: the recorded ones
        stream = TrainStream(members, sets, state.blend_start, state.blend_size, batch_start, tr.global_batch_size,
                             raw if state.blend_start == 0 else None,
                             blend=reuse if reuse is not None and len(reuse) == state.blend_size else None)
    else:
        stream = _new_blend(config, state, prefixes, weights, datasets, set(overridden), batch_start)
    stream.resumed = summary(state, stream, not unchanged, overridden, lambda p: _train_split(config, p)[1])
    return stream


def _new_blend(config: Config, state: DataState, prefixes: list[str], weights: list[float],
               datasets: dict[str, GPTDataset], overridden: set[str], batch_start: tuple[int, int]) -> TrainStream:
    """A blend starting at the checkpoint's consumed samples: kept datasets continue, new ones start at 0."""
    tr = config.training
    recorded = {m.prefix: m for m in state.members}
    remaining = max((tr.train_iters - state.iteration) * tr.global_batch_size, tr.global_batch_size)
    members = []
    for prefix, weight in zip(prefixes, weights, strict=True):
        old = recorded.get(prefix) if prefix not in overridden else None
        members.append(MemberState(prefix, weight, old.num_samples if old else None,
                                   start=old.consumed if old else 0, consumed=old.consumed if old else 0))
    active = [m for m in members if m.weight > 0]
    sizes, index = new_blend_sizes([m.weight for m in active], remaining)  # the weights a resume reads back
    for member, size in zip(active, sizes, strict=True):
        if member.num_samples is None:  # never read: ordered for what the rest of the run asks of it
            member.num_samples = size
    sets = [_dataset(config, m.prefix, m.num_samples, datasets) if m.weight > 0 else None for m in members]
    active_sets = [s for s in sets if s is not None]
    if len(active_sets) != len(active):  # a dataset whose train split holds no sample
        empty = next(m.prefix for m, s in zip(members, sets) if m.weight > 0 and s is None)
        raise DataError(f"--data-path: {empty} has no training sample of {config.model.seq_length + 1} tokens")
    kept = set(prefixes)
    members += [MemberState(**{**m.to_record(), "weight": 0.0, "start": m.consumed, "removed": True})
                for m in state.members if m.prefix not in kept]
    sets += [None] * (len(members) - len(sets))
    return TrainStream(members, sets, state.consumed_samples, remaining, batch_start, tr.global_batch_size,
                       indices=index if len(active) > 1 else None)


def _dataset(config: Config, prefix: str, num_samples: int | None, built: dict[str, GPTDataset]) -> GPTDataset | None:
    """``prefix``'s train split in the order built for ``num_samples`` (the builder's object when it is that)."""
    have = built.get(prefix)
    if have is not None and have.num_samples == num_samples:
        return have
    indexed, doc_range = _train_split(config, prefix)[0]
    d = config.data
    if d.sft:
        tokenizer = build_tokenizer(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file,
                                    config.model.vocab_size) or load_tokenizer(prefix)
        options = SFTOptions(tokenizer.eod_id, d.sft_truncate)
        dataset = SFTDataset(indexed, doc_range, config.model.seq_length, config.training.seed, num_samples,
                             d.data_cache_path, "train", options)
        return dataset if len(dataset) else None
    dataset = GPTDataset(indexed, doc_range, config.model.seq_length, config.training.seed, num_samples,
                         config.data.data_cache_path, "train")
    return dataset if len(dataset) else None


def _train_split(config: Config, prefix: str) -> tuple[tuple[IndexedDataset, tuple[int, int]], int]:
    """((indexed dataset, train document range), tokens in that range) of ``prefix``."""
    indexed = IndexedDataset(prefix)
    lo, hi = split_document_ranges(indexed.num_documents, parse_split(train_data(config)[1]))[0]
    return (indexed, (lo, hi)), int(indexed.sequence_lengths[lo:hi].astype("int64").sum())
