"""Megatron-LM's tokenizer flags: ``--tokenizer-type``, ``--tokenizer-model``, ``--vocab-file``, ``--merge-file``.

A Megatron user keeps the flags they have: ``GPT2BPETokenizer`` (GPT-2's ``vocab.json`` + ``merges.txt``),
``HuggingFaceTokenizer`` (a local Hugging Face tokenizer directory or its ``tokenizer.json``, loaded with the
``tokenizers`` library: no ``transformers`` and no network) and ``NullTokenizer`` (text is whitespace-
separated ids, ``eod = --vocab-size``). ptdp's own choices stay available as ``ByteTokenizer`` (the zero-flag
default) and ``PTDPBPETokenizer`` (a ``PREFIX.tokenizer.json``). Without ``--tokenizer-type`` the tokenizer
is the one recorded beside the data, as before.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from ptdp.data.errors import DataError
from ptdp.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer

TOKENIZER_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer", "ByteTokenizer", "PTDPBPETokenizer")
UNSUPPORTED = ("BertWordPieceLowerCase", "BertWordPieceCase", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
               "Llama2Tokenizer", "TikTokenizer", "MultimodalTokenizer")


class NullTokenizer:
    """Megatron's ``NullTokenizer``: ids written as text ("12 7 3"); ``eod_id = vocab_size`` (one extra id)."""

    name = "null"
    bos_id: int | None = None

    def __init__(self, vocab_size: int) -> None:
        self.eod_id = int(vocab_size)
        self.vocab_size = int(vocab_size) + 1
        self.fingerprint = f"null-{vocab_size}"

    def encode(self, text: str) -> list[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            raise DataError("NullTokenizer: documents must be whitespace-separated integer ids") from None
        if any(not 0 <= i < self.eod_id for i in ids):
            raise DataError(f"NullTokenizer: an id is outside [0, --vocab-size {self.eod_id})")
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def _hf_file(model: str | None) -> str:
    if not model:
        raise DataError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR (or DIR/tokenizer.json)")
    path = os.path.join(model, "tokenizer.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        raise DataError(f"--tokenizer-model: no tokenizer at {path} (a Hugging Face tokenizer directory holds a "
                        "tokenizer.json; convert slow tokenizers with transformers' save_pretrained)")
    return path


def _gpt2_bpe(vocab_file: str | None, merge_file: str | None) -> BPETokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
        if not path or not os.path.isfile(path):
            raise DataError(f"{flag}: GPT2BPETokenizer needs a readable file, got {path!r}")
    try:
        tok = HFTokenizer(models.BPE.from_file(vocab_file, merge_file))
    except Exception as err:  # tokenizers raises a bare Exception on bad files
        raise DataError(f"--vocab-file/--merge-file: cannot load {vocab_file} / {merge_file} "
                        f"({str(err).splitlines()[0]})") from None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return BPETokenizer(tok)


def build_tokenizer(
    tokenizer_type: str | None,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    vocab_size: int | None = None,
) -> Tokenizer | None:
    """The tokenizer the flags name; None when ``--tokenizer-type`` is not given (use the data's own)."""
    if tokenizer_type is None:
        return None
    if tokenizer_type in UNSUPPORTED:
        raise DataError(f"--tokenizer-type {tokenizer_type} is not supported; export it as a Hugging Face "
                        "tokenizer.json and use --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR")
    if tokenizer_type == "HuggingFaceTokenizer":
        return BPETokenizer.from_file(_hf_file(tokenizer_model))
    if tokenizer_type == "PTDPBPETokenizer":
        return BPETokenizer.from_file(_hf_file(tokenizer_model))
    if tokenizer_type == "GPT2BPETokenizer":
        return _gpt2_bpe(vocab_file, merge_file)
    if tokenizer_type == "NullTokenizer":
        if not vocab_size or vocab_size < 1:
            raise DataError("--tokenizer-type NullTokenizer needs --vocab-size N (ids are 0..N-1, eod is N)")
        return NullTokenizer(vocab_size)
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    raise DataError(f"--tokenizer-type: unknown {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}")
