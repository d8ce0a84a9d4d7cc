"""Hugging Face ``transformers`` interop: GPT-2 (``convert``, which also holds ``ptdp export`` / ``ptdp import``), Llama (``llama``), Mixtral and Qwen2-MoE (``moe``)."""
