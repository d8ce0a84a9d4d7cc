"""Plain models: GPT-2 and the Llama family, one process, no parallelism (``docs/architecture.md``).

Nothing here imports torch's distributed package or ptdp's parallelism modules (an import-linter
contract in ``pyproject.toml``, and tests/test_architecture.py); ``ptdp.parallel.parallelize`` transforms these
modules from outside.
"""

import importlib

# Each name loads its module (and torch) on first use: ``ptdp.models.flops`` and ``ptdp.models.rotary`` are
# plain arithmetic that the planner, the simulator and the command line's parsers read without torch.
_MODULE_OF = {
    **dict.fromkeys(["MLP", "TIED_EMBEDDING", "Attention", "Embedding", "GPTModel", "TransformerLayer"], "gpt"),
    **dict.fromkeys(["CausalAttention", "DropoutAdd", "Linear", "Logits", "SequencePositions", "norm"], "layers"),
    **dict.fromkeys(["GroupedExperts", "LocalDispatcher", "MoELayer", "TopKRouter"], "moe"),
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
