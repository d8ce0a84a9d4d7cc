"""Gated DeltaNet layers and gated attention (Qwen3-Next; ``ModelConfig``): which layers are linear, and the
combinations ptdp refuses (one line each) instead of computing something else.

``linear_attention_layers`` reads ``--linear-attention-freq`` as Megatron-LM does: N gives N - 1 linear
layers then one full-attention layer, repeated (layer i is full attention iff (i + 1) % N == 0); a list marks
each layer, 1 linear and 0 full attention. Nothing here imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ptdp.config.validate_moe import moe_layer_pattern

if TYPE_CHECKING:
    from ptdp.config.schema import Config, ModelConfig

FLAG = "--linear-attention-freq"


def linear_attention_layers(cfg: ModelConfig) -> list[bool]:
    """Per layer: True for a Gated DeltaNet layer, False for softmax attention. ValueError naming the flag
    for a pattern it cannot read."""
    if cfg.experimental_attention_variant != "gated_delta_net":
        return [False] * cfg.num_layers
    freq = cfg.linear_attention_freq
    if freq is None:
        return [True] * cfg.num_layers
    text = str(freq).strip()
    if text.isdigit():
        n = int(text)
        if n < 1:
            raise ValueError(f"{FLAG} must be a positive integer or a list, got {text}")
        return [(i + 1) % n != 0 for i in range(cfg.num_layers)]
    try:
        return moe_layer_pattern(text, cfg.num_layers)
    except ValueError as e:
        raise ValueError(str(e).replace("--moe-layer-freq", FLAG)) from None


def linear_layers_or_none(cfg: ModelConfig) -> list[bool]:
    """:func:`linear_attention_layers`, or no linear layer where the pattern does not read (reported apart)."""
    try:
        return linear_attention_layers(cfg)
    except ValueError:
        return []


def linear_errors(config: Config) -> list[str]:
    """The Gated DeltaNet flags against each other and against the parallelisms."""
    m = config.model
    errors = []
    if m.experimental_attention_variant is None:
        if m.linear_attention_freq is not None:
            errors.append(f"{FLAG} needs --experimental-attention-variant gated_delta_net")
        return errors
    for flag, value in (("--linear-conv-kernel-dim", m.linear_conv_kernel_dim),
                        ("--linear-key-head-dim", m.linear_key_head_dim),
                        ("--linear-value-head-dim", m.linear_value_head_dim),
                        ("--linear-num-key-heads", m.linear_num_key_heads),
                        ("--linear-num-value-heads", m.linear_num_value_heads)):
        if value < 1:
            errors.append(f"{flag} must be a positive integer, got {value}")
    if min(m.linear_num_key_heads, m.linear_num_value_heads) >= 1 \
            and m.linear_num_value_heads % m.linear_num_key_heads:
        errors.append(f"--linear-num-value-heads {m.linear_num_value_heads} must be a multiple of "
                      f"--linear-num-key-heads {m.linear_num_key_heads}")
    try:
        linear_attention_layers(m)
    except ValueError as e:
        errors.append(str(e))
    t = config.parallel.tensor_model_parallel_size
    if m.linear_num_key_heads >= 1 and m.linear_num_key_heads % t:
        errors.append(f"--linear-num-key-heads {m.linear_num_key_heads} must be divisible by "
                      f"--tensor-model-parallel-size {t} (each rank holds whole key-head groups)")
    c = config.parallel.context_parallel_size
    if c > 1 and any(linear_layers_or_none(m)):
        errors += _context_errors(config, c, t)
    if m.multi_latent_attention:
        errors.append("--experimental-attention-variant with --multi-latent-attention is not supported")
    if m.window_size is not None:
        errors.append("--experimental-attention-variant with --window-size is not supported")
    return errors


def _context_errors(config: Config, c: int, t: int) -> list[str]:
    """Context parallelism of the Gated DeltaNet layers (``ptdp.parallel.context.linear``)."""
    m, kind = config.model, config.parallel.linear_attention_cp_comm_type
    if kind == "a2a":
        if (m.linear_num_key_heads // max(t, 1)) % c:
            return [f"--linear-attention-cp-comm-type a2a needs the key heads per tensor-parallel rank "
                    f"({m.linear_num_key_heads}/{t}) divisible by --context-parallel-size {c}"]
        return []
    chunk = m.seq_length // (2 * c)
    errors = []
    if chunk < m.linear_conv_kernel_dim - 1:
        errors.append(f"--linear-attention-cp-comm-type state_passing needs each of the 2c sequence chunks "
                      f"({chunk} tokens) at least --linear-conv-kernel-dim - 1 = {m.linear_conv_kernel_dim - 1} long")
    return errors
