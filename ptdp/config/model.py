"""The model section of the configuration: the architecture's flags (Megatron-LM's names), one field each.

A model family (``ptdp.models.families``) is a set of values of these fields; the defaults are GPT-2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ptdp.config.fields import opt


@dataclass
class ModelConfig:
    num_layers: int = opt(4, "number of transformer layers")
    hidden_size: int = opt(128, "hidden size h")
    num_attention_heads: int = opt(4, "attention heads a")
    ffn_hidden_size: int | None = opt(None, "MLP hidden size (default 4h)")
    seq_length: int = opt(128, "sequence length s")
    max_position_embeddings: int | None = opt(
        None, "the longest sequence the model is built for (a learned position table's rows; the context a "
        "rotary model was trained or imported at); default --seq-length. --seq-length may be anything up to it")
    hidden_dropout: float = opt(0.1, "dropout on the residual stream and embeddings")
    attention_dropout: float = opt(0.1, "dropout on attention probabilities")
    make_vocab_size_divisible_by: int = opt(128, "pad the vocabulary to a multiple of this (and of t)")
    init_method_std: float = opt(0.02, "std of the normal initialisation")
    norm_epsilon: float = opt(1e-5, "LayerNorm/RMSNorm epsilon", aliases=("--layernorm-epsilon",))
    # Llama-family options (Megatron-LM's flags); the defaults are the GPT-2 architecture above.
    position_embedding_type: str = opt("learned_absolute", "learned_absolute (GPT-2) or rope (rotary, Llama)",
                                       choices=["learned_absolute", "rope"])
    rotary_base: float = opt(10000.0, "RoPE base (theta) of the rotation frequencies")
    rotary_percent: float = opt(1.0, "fraction of each head's dimensions that RoPE rotates")
    use_rope_scaling: bool = opt(False, "Llama 3.1's RoPE frequency scaling (low/high frequency factors 1/4, "
                                 "original context 8192)")
    rope_scaling_factor: float = opt(8.0, "Llama 3.1 RoPE scaling factor (with --use-rope-scaling)")
    normalization: str = opt("LayerNorm", "LayerNorm (GPT-2) or RMSNorm (Llama)", choices=["LayerNorm", "RMSNorm"])
    swiglu: bool = opt(False, "SwiGLU MLP down(silu(gate(x)) * up(x)); default --ffn-hidden-size becomes "
                       "int(8h/3 / 64) * 64")
    openai_gelu: bool = opt(False, "the GeLU MLP computes the tanh approximation (GPT-2's, OpenAI's) whatever "
                            "the biases and --no-bias-gelu-fusion say (Megatron-LM's legacy models' flag; "
                            "docs/cli.md#gelu)")
    bias_gelu_fusion: bool = opt(True, "the exact (erf) GeLU also with linear biases: Megatron-LM's fused bias-GeLU, "
                                 "its default wherever there are biases, is the tanh approximation, its unfused "
                                 "GeLU the exact one (so the default is tanh with biases, exact with "
                                 "--disable-bias-linear; docs/cli.md#gelu)", flag="--no-bias-gelu-fusion")
    group_query_attention: bool = opt(False, "grouped-query attention: --num-query-groups K/V heads")
    num_query_groups: int = opt(1, "key/value head groups G with --group-query-attention (t must divide G)")
    untie_embeddings_and_output_weights: bool = opt(False, "a separate output layer instead of the input "
                                                    "embedding")
    disable_bias_linear: bool = opt(False, "no biases in the attention and MLP linears (Llama)")
    add_qkv_bias: bool = opt(False, "a bias in the QKV projection even with --disable-bias-linear (Qwen2)")
    disable_bias_norm: bool = opt(False, "no bias in the LayerNorms (with --disable-bias-linear: no bias anywhere, "
                                  "nanoGPT's bias=False). Not a Megatron-LM flag: there the LayerNorm always has "
                                  "one and RMSNorm none, so --disable-bias-linear leaves the LayerNorms' biases")
    kv_channels: int | None = opt(None, "per-head dimension (default hidden size / heads)")
    qk_layernorm: bool = opt(False, "normalise each head's query and key (--normalization over the head "
                             "dimension) before the rotary embedding (Qwen3, Gemma 3, OLMo 2)")
    # Gemma 3's options: sliding-window attention and its layer pattern, sandwich norms, (1 + w) norms, GeGLU
    window_size: int | None = opt(None, "sliding-window attention: query i attends to keys i - w < j <= i (the "
                                  "window counts the token itself, as HF's sliding_window); unset: the whole context")
    window_attn_skip_freq: str | None = opt(
        None, "with --window-size, which layers attend to the whole context: N (every N-th layer, 1-based, is "
        "global: Gemma 3's 6) or a Python list per layer, 1 sliding and 0 global, e.g. \"([1]*5+[0])*2\"; "
        "unset: every layer slides")
    attn_logit_softcapping: float | None = opt(None, "Gemma 2's soft-capping of the attention scores: "
                                               "cap·tanh(score/cap) before the softmax; unset: none")
    final_logit_softcapping: float | None = opt(None, "Gemma 2's soft-capping of the output logits: "
                                                "cap·tanh(logit/cap) before the loss; unset: none")
    local_rotary_base: float | None = opt(None, "RoPE base of the sliding-window layers (Gemma 3: 10,000 with "
                                          "--rotary-base 1,000,000 for the global ones); default --rotary-base")
    sandwich_norm: bool = opt(False, "a norm after the attention and after the MLP, before each residual add "
                              "(Gemma 2/3's post_attention/post_feedforward norms)")
    apply_layernorm_1p: bool = opt(False, "zero-centred norm weights: y = norm(x)·(1 + w), computed in fp32 "
                                   "(Gemma's RMSNorm; weights initialised to 0)")
    scale_embedding: bool = opt(False, "multiply the input embeddings by √h, rounded to the model's dtype (Gemma)")
    geglu: bool = opt(False, "GeGLU MLP down(gelu_tanh(gate(x)) * up(x)) (Gemma); fc1 holds [gate; up] as "
                      "--swiglu's does, with its default --ffn-hidden-size")
    softmax_scale: float | None = opt(None, "the attention softmax scale (Gemma 3: query_pre_attn_scalar^-1/2); "
                                      "default 1/√head-dim")
    # GPT-OSS's options: attention sinks, the clamped quick-GeGLU with its +1 on the linear half
    softmax_type: str = opt("vanilla", "attention softmax: vanilla, learnable (an extra logit per head, a learned "
                            "attention sink: GPT-OSS) or off-by-one (that logit fixed at 0)",
                            choices=["vanilla", "learnable", "off-by-one"])
    quick_geglu: bool = opt(False, "gated MLP down(g·sigmoid(1.702·g) * (up + --glu-linear-offset)) (GPT-OSS's "
                            "experts); fc1 holds [gate; up] as --swiglu's does")
    glu_linear_offset: float = opt(0.0, "added to the linear half of a gated MLP before the product (GPT-OSS: 1)")
    activation_func_clamp_value: float | None = opt(
        None, "a gated MLP clamps its gate to <= v and its linear half to [-v, v] before the activation (GPT-OSS: 7)")
    # Qwen3-Next's options: Gated DeltaNet layers among gated full-attention ones (``ptdp.models.gated_deltanet``)
    attention_output_gate: bool = opt(False, "gate each attention head's output by sigmoid(x·W_g) before the output "
                                      "projection (Qwen3-Next's full-attention layers)")
    experimental_attention_variant: str | None = opt(
        None, "gated_delta_net: the layers --linear-attention-freq picks are Gated DeltaNet (linear attention with "
        "a gated delta-rule state) instead of softmax attention", choices=["gated_delta_net"])
    linear_attention_freq: str | None = opt(
        None, "with --experimental-attention-variant, which layers are linear: N ((N-1) linear layers, then one "
        "full-attention layer, repeated: Qwen3-Next's 4) or a Python list per layer, 1 linear and 0 full "
        "attention, e.g. \"([1]*3+[0])*2\"; unset: every layer is linear")
    linear_conv_kernel_dim: int = opt(4, "Gated DeltaNet: taps of the causal depthwise convolution over q, k, v")
    linear_key_head_dim: int = opt(128, "Gated DeltaNet: query/key head dimension K (the state is K x V per head)")
    linear_value_head_dim: int = opt(128, "Gated DeltaNet: value head dimension V")
    linear_num_key_heads: int = opt(16, "Gated DeltaNet: query/key heads")
    linear_num_value_heads: int = opt(32, "Gated DeltaNet: value heads (a multiple of the key heads; each key "
                                      "head serves value/key of them)")
    vocab_size: int | None = opt(None, "vocabulary size (default: the tokenizer's)")
    recompute_granularity: str | None = opt(
        None, "activation recomputation: full (whole layers) or selective (attention core only)",
        choices=["full", "selective"])
    recompute_method: str | None = opt(
        None, "with full: uniform (units of --recompute-num-layers layers) or block (only the first "
        "--recompute-num-layers layers of each chunk); default uniform", choices=["uniform", "block"])
    recompute_num_layers: int | None = opt(None, "layers per recompute unit (uniform) or recomputed layers "
                                           "per chunk (block); default 1")
    distribute_saved_activations: bool = opt(
        False, "with --recompute-granularity full: keep each checkpointed layer input as 1/t across the "
        "tensor-parallel ranks, all-gathered for the recompute (ZeRO-R's partitioned activation checkpointing; "
        "needs t > 1, not with --sequence-parallel)")
    checkpoint_in_cpu: bool = opt(
        False, "with --recompute-granularity full on a GPU: keep the checkpointed layer inputs (or their 1/t "
        "slices) in pinned host memory until the recompute (ZeRO-R's CPU checkpointing; Megatron-DeepSpeed's flag)")
    compile: bool = opt(False, "torch.compile each transformer layer on a GPU (on the CPU: fused bias-GeLU and "
                        "bias-dropout-add); eager if it fails")
    multi_latent_attention: bool = opt(False, "multi-latent attention (DeepSeek-V2/V3): low-rank q, kv; decoupled RoPE")
    q_lora_rank: int | None = opt(None, "rank of the query compression (unset: one full query projection)")
    kv_lora_rank: int = opt(32, "rank of the key/value compression (the latent an inference cache keeps)")
    qk_head_dim: int = opt(128, "per-head query/key dimension without the RoPE part")
    qk_pos_emb_head_dim: int = opt(64, "per-head query/key RoPE dimension (the key's is shared by the heads)")
    v_head_dim: int = opt(128, "per-head value dimension")
    rope_type: str | None = opt(None, "rope or yarn (unset: yarn with MLA, else rope)", choices=["rope", "yarn"])
    rotary_scaling_factor: float = opt(1.0, "YaRN context-extension factor (1: no scaling)")
    mscale: float = opt(1.0, "YaRN: tables times mscale(f, mscale)/mscale(f, all-dim); mscale(f, m)=0.1*m*ln(f)+1")
    mscale_all_dim: float = opt(0.0, "YaRN: the softmax scale times mscale(factor, mscale-all-dim)^2")
    original_max_position_embeddings: int = opt(4096, "YaRN: the context length the model was trained at")
    beta_fast: float = opt(32.0, "YaRN: rotations above which a dimension is not interpolated")
    beta_slow: float = opt(1.0, "YaRN: rotations below which a dimension is fully interpolated")
    yarn_correction_range_round_to_int: bool = opt(
        True, "YaRN: keep the ramp between beta-fast and beta-slow unrounded (GPT-OSS; HF's truncate=false); "
        "default: its ends rounded outwards to whole dimensions", flag="--no-yarn-correction-range-round-to-int")
    mtp_num_layers: int | None = opt(None, "multi-token prediction: D modules, k-th predicting t+k+1 (0: none)")
    mtp_loss_scaling_factor: float = opt(0.1, "lambda: the objective adds lambda * the MTP modules' mean CE")

    @property
    def ffn_size(self) -> int:
        """Megatron's default: 4h, or with SwiGLU 2/3 of it rounded down to a multiple of 64 (same params)."""
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.gated_mlp else 4 * self.hidden_size

    @property
    def gated_mlp(self) -> bool:
        """A gated MLP (SwiGLU, GeGLU or quick-GeGLU): fc1 is [gate; up], three ffn matrices."""
        return self.swiglu or self.geglu or self.quick_geglu

    @property
    def gelu_approximate(self) -> str:
        """The plain GeLU MLP's ``F.gelu(approximate=...)``: "tanh" where Megatron-LM computes the tanh form
        (``--openai-gelu``, or its fused bias-GeLU: biases and ``bias_gelu_fusion``), else "none" (exact erf)."""
        tanh = self.openai_gelu or (self.bias_gelu_fusion and not self.disable_bias_linear)
        return "tanh" if tanh else "none"

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads: G with --group-query-attention, else one per query head."""
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads

    @property
    def add_bias_linear(self) -> bool:
        return not self.disable_bias_linear

    @property
    def tied_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    def padded_vocab_size(self, vocab_size: int, tp: int) -> int:
        """Pad to a multiple of lcm(divisible_by, t), the same for every layout whose t divides it."""
        multiple = math.lcm(self.make_vocab_size_divisible_by, tp)
        return -(-vocab_size // multiple) * multiple
