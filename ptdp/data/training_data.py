"""The datasets a run reads, from its config: the one function ``ptdp train`` and ``ptdp samples`` share.

Sizes follow Megatron's ``train_valid_test_num_samples``: ``train_iters * B`` training samples,
``(train_iters // eval_interval + 1) * eval_iters * B`` validation samples (eval_interval defaulting to
Megatron's 1000) and ``eval_iters * B`` test samples; they fix the number of epochs and so the sample order,
exactly as in Megatron, so the same flags give the same batches in both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ptdp.data.builder import DataSplits, build_datasets
from ptdp.data.tokenizer_flags import build_tokenizer

if TYPE_CHECKING:
    from ptdp.config import Config

MEGATRON_DEFAULT_EVAL_INTERVAL = 1000


def train_valid_test_num_samples(config: Config) -> tuple[int, int, int]:
    tr = config.training
    eval_interval = tr.eval_interval or MEGATRON_DEFAULT_EVAL_INTERVAL
    batch = tr.global_batch_size
    return (tr.train_iters * batch, (tr.train_iters // eval_interval + 1) * tr.eval_iters * batch,
            tr.eval_iters * batch)


def datasets_for_config(config: Config) -> DataSplits:
    """train/valid/test of ``config`` (raises :class:`DataError` with one line on bad input)."""
    d = config.data
    tokenizer = build_tokenizer(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file,
                                config.model.vocab_size)
    return build_datasets(d.data_path or None, d.split, config.model.seq_length, config.training.seed,
                          num_samples=train_valid_test_num_samples(config), cache_path=d.data_cache_path,
                          tokenizer=tokenizer)
