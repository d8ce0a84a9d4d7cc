"""Plain models: GPT-2 and the Llama family, one process, no parallelism (``docs/architecture.md``).

Nothing here imports torch's distributed package or ptdp's parallelism modules (an import-linter
contract in ``pyproject.toml``, and tests/test_architecture.py); ``ptdp.parallel.parallelize`` transforms these
modules from outside.
"""

from ptdp.models.gpt import MLP, TIED_EMBEDDING, Attention, Embedding, GPTModel, TransformerLayer
from ptdp.models.layers import (
           CausalAttention,
           CrossEntropy,
           DropoutAdd,
           Linear,
           Logits,
           SequencePositions,
           norm,
)
from ptdp.models.mla import MultiLatentAttention
from ptdp.models.moe import GroupedExperts, LocalDispatcher, MoELayer, TopKRouter
from ptdp.models.mtp import MultiTokenPrediction

__all__ = ["MLP", "TIED_EMBEDDING", "Attention", "CausalAttention", "CrossEntropy", "DropoutAdd", "Embedding",
           "GPTModel", "GroupedExperts", "Linear", "LocalDispatcher", "Logits", "MoELayer", "MultiLatentAttention",
           "MultiTokenPrediction", "SequencePositions", "TopKRouter", "TransformerLayer", "norm"]
