"""Data pipeline: indexed token files, tokenizers, the default corpus, GPT datasets, blends, microbatches.

See docs/data.md for the file format and the sample-order contract.
"""

from ptdp.data.blended_dataset import BlendedDataset
from ptdp.data.builder import DataSplits, build_datasets
from ptdp.data.default_corpus import default_corpus_prefix
from ptdp.data.errors import DataError
from ptdp.data.gpt_dataset import GPTDataset
from ptdp.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, dtype_for_vocab
from ptdp.data.microbatch import get_microbatch, microbatch_positions
from ptdp.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "BPETokenizer",
    "BlendedDataset",
    "ByteTokenizer",
    "DataError",
    "DataSplits",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "Tokenizer",
    "build_datasets",
    "default_corpus_prefix",
    "dtype_for_vocab",
    "get_microbatch",
    "load_tokenizer",
    "microbatch_positions",
]
