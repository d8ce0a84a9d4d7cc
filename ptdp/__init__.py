"""ptdp: PTD-P (pipeline x tensor x data parallel) GPT training on torch.distributed."""

__version__ = "0.1.0"
