"""Tokenizers: byte-level (default, no training) and byte-level BPE (Hugging Face ``tokenizers``).

Both satisfy the :class:`Tokenizer` protocol the model and trainer rely on: ``vocab_size`` is the real
vocabulary (the model pads it for tensor parallelism itself), ``eod_id`` separates documents in the token
stream, and ``decode`` never raises on a window that cuts a multi-byte character (errors="replace").
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from ptdp.data.errors import DataError

EOD_TOKEN = "<|endoftext|>"
TOKENIZER_SUFFIX = ".tokenizer.json"
# Special tokens of Llama-style ``tokenizer.json`` files (SentencePiece Llama 1/2, tiktoken Llama 3), in
# order of preference: the document end is the EOS token, and each document starts with BOS.
EOS_TOKENS = (EOD_TOKEN, "</s>", "<|end_of_text|>", "<eos>")
BOS_TOKENS = ("<s>", "<|begin_of_text|>", "<bos>")


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    eod_id: int
    bos_id: int | None  # the id each document starts with (None: none, as GPT-2's)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """Token id = UTF-8 byte value; 256 is end-of-document. Needs no training and no files."""

    vocab_size: int = 257
    eod_id: int = 256
    bos_id: int | None = None
    name = "byte"
    fingerprint = "byte"  # equal fingerprints <=> identical vocabularies (checked when blending)

    def encode(self, text: str) -> list[int]:
        # "replace": json.loads can yield lone surrogates, which UTF-8 cannot encode.
        return list(text.encode("utf-8", errors="replace"))

    def encode_bytes(self, text: str) -> bytes:
        """Fast path for preprocessing: the token ids as a bytes object (one byte per token)."""
        return text.encode("utf-8", errors="replace")

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class BPETokenizer:
    """A Hugging Face ``tokenizers`` file: ptdp's byte-level BPE (eod = ``<|endoftext|>``, no BOS) or a
    Llama-style ``tokenizer.json`` (eod = its EOS token, and BOS starts every encoded text, as Llama was
    trained). ``bos_id`` is None when the file has no BOS token."""

    name = "bpe"

    def __init__(self, hf_tokenizer) -> None:
        self._tok = hf_tokenizer
        eod = next((i for i in map(hf_tokenizer.token_to_id, EOS_TOKENS) if i is not None), None)
        if eod is None:
            raise DataError(
                f"tokenizer has no end-of-document token (one of {', '.join(EOS_TOKENS)}); retrain it with "
                "`ptdp preprocess --tokenizer bpe` or use a Llama-style tokenizer.json"
            )
        self.eod_id: int = eod
        self.bos_id: int | None = None
        if hf_tokenizer.token_to_id(EOD_TOKEN) is None:  # ptdp's own BPE files never start with BOS
            self.bos_id = next((i for i in map(hf_tokenizer.token_to_id, BOS_TOKENS) if i is not None), None)
        self.vocab_size: int = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        self.fingerprint = hashlib.sha256(hf_tokenizer.to_str().encode()).hexdigest()[:16]

    @classmethod
    def from_file(cls, path: str) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            return cls(HFTokenizer.from_file(path))
        except Exception as err:  # tokenizers raises a bare Exception on bad JSON
            raise DataError(f"cannot load tokenizer {path} ({str(err).splitlines()[0]})") from None

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        """Train on ``texts``; the 256 byte symbols plus eod are always in the vocabulary."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        if vocab_size < 257:
            raise DataError(f"--vocab-size {vocab_size} is too small for byte-level BPE; use at least 257")
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOD_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    def save(self, path: str) -> None:
        """Write atomically so a reader never sees half a JSON file."""
        tmp = f"{path}.tmp.{os.getpid()}"
        self._tok.save(tmp)
        os.replace(tmp, path)

    def encode(self, text: str) -> list[int]:
        return self._with_bos(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self._with_bos(enc.ids) for enc in self._tok.encode_batch(texts, add_special_tokens=False)]

    def _with_bos(self, ids: list[int]) -> list[int]:
        # explicit rather than through the file's post-processor, which only some files have
        return ids if self.bos_id is None else [self.bos_id, *ids]

    def decode(self, ids: Sequence[int], keep_special: bool = False) -> str:
        # The ByteLevel decoder maps invalid UTF-8 to U+FFFD, matching ByteTokenizer; eod is skipped in both
        # (``keep_special``: special tokens shown, as a chat template's turn markers).
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=not keep_special)


def load_tokenizer(prefix: str) -> Tokenizer:
    """The tokenizer a dataset was written with: BPE when ``PREFIX.tokenizer.json`` exists, else bytes."""
    path = prefix + TOKENIZER_SUFFIX
    if os.path.exists(path):
        return BPETokenizer.from_file(path)
    return ByteTokenizer()
