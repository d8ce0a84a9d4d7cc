"""The data flags' files, checked before any worker starts (``ptdp/runtime/startup.py``): every dataset
prefix of every ``*data_path`` flag (its ``.bin`` and ``.idx``, their headers and sizes) and the
tokenizer the flags name (built, which reads its files). No torch here: the launcher runs this.

The messages are those the workers would raise (``IndexedDataset``, ``build_tokenizer``), one line each,
so a problem reads the same whether the launcher or a rank finds it.
"""

from __future__ import annotations

import dataclasses

from ptdp.config import Config
from ptdp.data.builder import _strip_suffix, parse_data_path
from ptdp.data.errors import DataError
from ptdp.data.indexed_dataset import IndexedDataset
from ptdp.data.tokenizer_flags import build_tokenizer


def data_prefixes(config: Config) -> list[tuple[str, str]]:
    """(flag, prefix) for every dataset the data flags name (``--data-path`` and any other
    ``*_data_path`` flag), each prefix once."""
    found: list[tuple[str, str]] = []
    for name, value in dataclasses.asdict(config.data).items():
        if name.endswith("data_path") and value and isinstance(value, list | tuple):
            try:
                names = parse_data_path(list(value))[0]
            except DataError:
                continue  # the blend's own syntax error is the worker's to say
            flag = "--" + name.replace("_", "-")
            found += [(flag, _strip_suffix(p)) for p in names if _strip_suffix(p) not in [q for _, q in found]]
    return found


def data_file_errors(config: Config) -> list[str]:
    """One line per unreadable or damaged dataset, and for a tokenizer the flags name but cannot build."""
    errors = []
    for flag, prefix in data_prefixes(config):
        try:
            IndexedDataset(prefix)
        except DataError as e:
            errors.append(str(e).replace("--data-path:", f"{flag}:", 1))
    d = config.data
    try:
        build_tokenizer(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file, config.model.vocab_size)
    except DataError as e:
        errors.append(str(e))
    return errors
