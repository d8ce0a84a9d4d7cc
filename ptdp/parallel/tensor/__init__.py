"""Tensor (intra-layer) model parallelism: layers, region operators, cross-entropy and RNG streams."""

from ptdp.parallel.collectives import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from ptdp.parallel.tensor.cross_entropy import (
    language_model_loss,
    mask_padded_vocab,
    vocab_parallel_cross_entropy,
)
from ptdp.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLogits,
)
from ptdp.parallel.tensor.random import get_rng_tracker, model_parallel_seed

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabParallelLogits",
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "get_rng_tracker",
    "language_model_loss",
    "mask_padded_vocab",
    "model_parallel_seed",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "vocab_parallel_cross_entropy",
]
