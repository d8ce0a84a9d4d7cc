"""The sharding rules of ``GPTModel`` (GPT-2, Llama, Mixtral/Qwen2-MoE, DeepSeek-V3, Qwen3, Qwen3-MoE, Gemma 3,
Qwen3-Next): Megatron's tensor-parallel plan, written as the data ``ptdp.models.sharding`` defines.

Per transformer layer: QKV (or MLA's up projections) and fc1 column-parallel, the output projection and
fc2 row-parallel; the layer norms (Gemma's sandwich norms after the attention and the MLP too) hold
gradients partial over the tokens under sequence parallelism, and
so do MLA's down projections and latent norms (whole on every rank, as Megatron-Core keeps them); a
per-head q/k norm (``--qk-layernorm``) holds gradients partial over the heads; the attention sinks
(``--softmax-type learnable``) are split by heads. Qwen3-Next: the attention's output gate column-parallel like
the queries; a Gated DeltaNet layer split by key-head groups (its input projections column-parallel, its
convolution and decay parameters by rows, ``HeadSplit``; its output norm, shared by the heads, partial over
them; its output projection row-parallel). A mixture of experts is
split by its own layout (``ptdp.parallel.expert``), so its MLP has no rule here. The embedding tables and
the output layer are split by vocabulary; multi-token prediction's modules as Megatron-Core splits them
(``eh_proj`` column-parallel with its output gathered, then back to this rank's tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ptdp.models.sharding import (
    ColumnParallel,
    HeadSharedInput,
    HeadSplit,
    PartialGradient,
    RowParallel,
    SequenceEntry,
    ShardingRules,
    VocabParallel,
    VocabParallelOutput,
    rules,
)

if TYPE_CHECKING:
    from ptdp.config import ModelConfig

TOKENS, HEADS = PartialGradient("tokens"), PartialGradient("heads")


def layer_rules(layer: str, cfg: ModelConfig) -> ShardingRules:
    """The rules of the transformer layers named by the pattern ``layer`` (e.g. ``layers.*``)."""
    attention = f"{layer}.attention"
    if cfg.multi_latent_attention:
        split = [(f"{attention}.{name}", ColumnParallel()) for name in ("q_proj", "q_up_proj", "kv_up_proj")]
        split += [(f"{attention}.rope_key_region", HeadSharedInput())]
        split += [(f"{attention}.{name}", TOKENS)
                  for name in ("q_down_proj", "kv_down_proj", "q_layernorm", "kv_layernorm")]
    else:
        split = [(f"{attention}.qkv", ColumnParallel()), (f"{attention}.q_layernorm", HEADS),
                 (f"{attention}.k_layernorm", HEADS), (f"{attention}.sinks", HeadSplit(("heads",))),
                 (f"{attention}.gate", ColumnParallel())]
    if cfg.experimental_attention_variant:  # Gated DeltaNet layers: split by key-head groups
        split += [(f"{attention}.in_proj_qkvz", ColumnParallel()), (f"{attention}.in_proj_ba", ColumnParallel()),
                  (f"{attention}.conv1d", HeadSplit()), (f"{attention}.decay", HeadSplit()),
                  (f"{attention}.out_layernorm", HEADS), (f"{attention}.out_proj", RowParallel())]
    return rules([*split, (f"{attention}.proj", RowParallel()), (f"{layer}.mlp.fc1", ColumnParallel()),
                  (f"{layer}.mlp.fc2", RowParallel()), (f"{layer}.input_layernorm", TOKENS),
                  (f"{layer}.post_attention_layernorm", TOKENS), (f"{layer}.post_self_attn_layernorm", TOKENS),
                  (f"{layer}.post_mlp_layernorm", TOKENS)])


def gpt_sharding_rules(cfg: ModelConfig) -> ShardingRules:
    """Every rule of a ``GPTModel`` built from ``cfg`` (a pipeline chunk holds some of the modules)."""
    tables = rules([(f"{name}.word_embeddings", VocabParallel()) for name in ("embedding", "embedding_copy")]
                   + [(name, SequenceEntry()) for name in ("embedding", "embedding_copy")]
                   + [(name, VocabParallel()) for name in ("lm_head", "output_layer")]
                   + [("final_layernorm", TOKENS), ("logits", VocabParallelOutput("logits"))])
    mtp = rules([("mtp.layers.*.eh_proj", ColumnParallel(gather_output=True, scatter_to_sequence=True)),
                 ("mtp.layers.*.embedding_layernorm", TOKENS), ("mtp.layers.*.hidden_layernorm", TOKENS),
                 ("mtp.layers.*.final_layernorm", TOKENS), ("mtp.cross_entropy", VocabParallelOutput("cross_entropy"))])
    return tables + layer_rules("layers.*", cfg) + mtp + layer_rules("mtp.layers.*.transformer_layer", cfg)
