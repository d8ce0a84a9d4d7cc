"""Plain models: GPT-2 and the Llama family, one process, no parallelism (``docs/architecture.md``).

Nothing here imports torch's distributed package or ptdp's parallelism modules (an import-linter
contract in ``pyproject.toml``, and tests/codebase/test_architecture.py); ``ptdp.parallel.parallelize`` transforms these
modules from outside.

The names below are imported on first use (PEP 562), so ``ptdp.models.flops`` (pure arithmetic, read by
the planner and the CLI's parser) does not import torch: ``ptdp train`` prints its first line before
torch loads.
"""

import importlib

_WHERE = {
    **dict.fromkeys(("MLP", "TIED_EMBEDDING", "Embedding", "GPTModel", "TransformerLayer"), "gpt"),
    "Attention": "attention",
    **dict.fromkeys(("CausalAttention", "CrossEntropy", "DropoutAdd", "Linear", "Logits", "SequencePositions", "norm",
                     "ZeroCenteredRMSNorm", "window_mask"), "layers"),
    **dict.fromkeys(("GroupedExperts", "LocalDispatcher", "MoELayer", "TopKRouter"), "moe"),
    "MultiLatentAttention": "mla",
    "MultiTokenPrediction": "mtp",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'ptdp.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"ptdp.models.{_WHERE[name]}"), name)
