"""Model FLOPs and parameter counts of a GPT, exactly as the PTD-P paper counts them.

See ptdp-facts.md, §FLOPs (the paper's Appendix, eq. 3). The trainer calls ``flops_per_iteration`` every
iteration to report TFLOP/s per GPU, so everything here is closed-form integer arithmetic.

Where the paper assumes ``ffn_hidden_size = 4h`` we keep its structure and only replace the MLP term, so
the general formulas reduce *exactly* to eq. (3) when ``ffn = 4h``:

* per layer forward, ``2·(matmul FLOPs)`` per multiply-add:
  QKV projection ``6·B·s·h²`` + attention output projection ``2·B·s·h²`` + MLP ``4·B·s·h·ffn``
  (two GEMMs of ``h × ffn``) + attention scores and weighted values ``4·B·s²·h``.
  With ``ffn = 4h`` that is the paper's ``24·B·s·h² + 4·B·s²·h``.
* logits: ``2·B·s·h·V`` forward.
* packed documents with ``--reset-attention-mask`` (ptdp-facts.md §Packed sequences): attention is
  computed inside each document only, so a sample's scores-and-values term ``4·s²·h`` becomes
  ``4·(sum of l_i²)·h`` over its documents' lengths l_i: ``attention_length`` is that sum divided by s
  (averaged over the samples; s itself for whole windows), and the term is ``4·B·s·attention_length·h``.
* a backward pass costs twice its forward; full activation recomputation runs the layers' forward once
  more (the logit layer is not recomputed), hence the factor 4 (= 96/24) or 3 (= 72/24) on layer terms
  and always 3 on the logit term.

Llama-family options (keyword arguments, all defaulting to GPT-2; ptdp-facts.md §Llama-family layers),
with ``q = a·d`` query/output width (``d`` = ``kv_channels``, default h/a, so q = h) and ``k = G·d`` the key
and value width of G query groups (G = a without GQA):

* attention projections ``2·B·s·h·(2q + 2k)``: Q and output ``h × q`` each, K and V ``h × k`` each;
  with q = h, k = h·G/a that is ``2·B·s·h·(2h + 2h·G/a)``;
* scores and values ``4·B·s²·q``;
* SwiGLU MLP ``6·B·s·h·ffn`` (gate, up and down, three ``h × ffn`` GEMMs) instead of ``4·B·s·h·ffn``;
* RMSNorm, rotary embeddings and the element-wise ops are not counted (as LayerNorm and GeLU are not);
  an untied output layer costs the same logit FLOPs as a tied one.

Mixture of experts (``moe``, a :class:`MoEShape`; issue 25): FLOPs and "active" parameters count what a token
goes through -- the router ``2·B·s·h·E``, its k experts' MLPs (``k`` times the MLP term with the experts'
hidden size), the shared expert's MLP and its gate ``2·B·s·h`` -- in the ``moe_layers`` MoE layers; the total
parameter count holds all E experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class MoEShape:
    """What the counts need of a mixture of experts: E, k, the experts' and the shared expert's hidden sizes,
    whether the shared expert is gated, and how many layers are MoE."""

    num_experts: int
    topk: int
    ffn: int
    moe_layers: int
    shared_ffn: int = 0
    shared_gate: bool = False


class ModelShape(Protocol):
    """What the counts read of a model: ``ptdp.config.ModelConfig`` (``ptdp train``) and the planner's
    ``GPTSpec`` both provide it under these names (Megatron's)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def seq_length(self) -> int: ...
    @property
    def vocab_size(self) -> int | None: ...
    @property
    def ffn_size(self) -> int: ...
    @property
    def group_query_attention(self) -> bool: ...
    @property
    def num_query_groups(self) -> int | None: ...
    @property
    def kv_channels(self) -> int | None: ...
    @property
    def swiglu(self) -> bool: ...
    @property
    def untie_embeddings_and_output_weights(self) -> bool: ...
    @property
    def position_embedding_type(self) -> str: ...
    @property
    def disable_bias_linear(self) -> bool: ...
    @property
    def disable_bias_norm(self) -> bool: ...
    @property
    def normalization(self) -> str: ...


def moe_shape(model: Any, moe: Any) -> MoEShape | None:
    """The :class:`MoEShape` of a ``ModelConfig`` and ``MoEConfig`` (None: dense)."""
    if moe is None or not moe.num_experts:
        return None
    from ptdp.config.validate_moe import moe_layer_pattern

    return MoEShape(moe.num_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size or model.ffn_size,
                    sum(moe_layer_pattern(moe.moe_layer_freq, model.num_layers)),
                    moe.moe_shared_expert_intermediate_size or 0, moe.moe_shared_expert_gate)


def _moe_mlp(h: int, moe: MoEShape, swiglu: bool, experts: int) -> tuple[int, int]:
    """(forward multiply-adds per token, parameters) of an MoE layer's MLP part through ``experts`` experts."""
    mats = 3 if swiglu else 2
    router, gate = moe.num_experts * h, h if moe.shared_gate else 0
    per_token = mats * h * (moe.topk * moe.ffn + moe.shared_ffn) + router + gate
    return per_token, mats * h * (experts * moe.ffn + moe.shared_ffn) + router + gate


def _ffn(hidden_size: int, ffn_hidden_size: int | None) -> int:
    return 4 * hidden_size if ffn_hidden_size is None else ffn_hidden_size


def _widths(h: int, num_attention_heads: int | None, num_query_groups: int | None,
            kv_channels: int | None) -> tuple[int, int]:
    """(q, k): query/output projection width a·d and key/value width G·d."""
    if num_attention_heads is None:
        return h, h
    d = kv_channels or h // num_attention_heads
    return num_attention_heads * d, (num_query_groups or num_attention_heads) * d


def architecture(model: ModelShape) -> dict[str, Any]:
    """The keyword arguments below for a ``ModelConfig`` or a planner ``GPTSpec``."""
    return {
        "num_attention_heads": model.num_attention_heads,
        "num_query_groups": model.num_query_groups if model.group_query_attention else None,
        "kv_channels": model.kv_channels, "swiglu": model.swiglu,
    }


def layer_forward_flops(hidden_size: int, seq_length: int, tokens: int, ffn_hidden_size: int | None = None, *,
                        num_attention_heads: int | None = None, num_query_groups: int | None = None,
                        kv_channels: int | None = None, swiglu: bool = False, moe: MoEShape | None = None,
                        attention_length: float | None = None) -> int:
    """Forward FLOPs of one transformer layer for ``tokens`` = B·s tokens of sequence length s.

    ``(2h·(2q + 2k) + mlp·h·ffn + 4·s·q)·B·s`` with mlp = 4 (GeLU) or 6 (SwiGLU); for GPT-2 (q = k = h)
    ``(8·h² + 4·h·ffn + 4·s·h)·B·s``, the paper's ``24·B·s·h² + 4·B·s²·h`` when ffn = 4h. Packed documents:
    ``attention_length`` (sum of l_i² / s, module docstring) replaces s in the attention term.
    """
    h, f = hidden_size, _ffn(hidden_size, ffn_hidden_size)
    q, k = _widths(h, num_attention_heads, num_query_groups, kv_channels)
    mlp = (6 if swiglu else 4) * h * f if moe is None else 2 * _moe_mlp(h, moe, swiglu, moe.topk)[0]
    attended = seq_length if attention_length is None else attention_length
    return int(tokens * (2 * h * (2 * q + 2 * k) + mlp) + round(tokens * 4 * attended * q))


def logit_forward_flops(hidden_size: int, vocab_size: int, tokens: int) -> int:
    """Forward FLOPs of the output (logit) layer: ``2·B·s·h·V``."""
    return 2 * tokens * hidden_size * vocab_size


def flops_per_iteration(
    num_layers: int,
    hidden_size: int,
    seq_length: int,
    vocab_size: int,
    global_batch_size: int,
    recompute: bool,
    ffn_hidden_size: int | None = None,
    attention_length: float | None = None,
    **arch: Any,
) -> int:
    """FLOPs of one training iteration (forward + backward [+ recomputed forward]) over the global batch.

    With ``recompute=True`` (full activation recomputation) and ffn = 4h this is the paper's eq. (3),
    ``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))``; without it the layer terms get 72 instead of 96 and the
    logit term stays ``6·B·s·h·V`` (ptdp-facts.md, §FLOPs). Selective recomputation re-runs only the
    attention core; like Megatron we do not count it (pass ``recompute=False``). ``attention_length``:
    packed documents' attention (module docstring).
    """
    tokens = global_batch_size * seq_length
    layer_passes = 4 if recompute else 3
    moe = arch.pop("moe", None)
    dense = num_layers - (moe.moe_layers if moe else 0)
    layers = dense * layer_passes * layer_forward_flops(hidden_size, seq_length, tokens, ffn_hidden_size,
                                                        attention_length=attention_length, **arch)
    if moe is not None:
        layers += moe.moe_layers * layer_passes * layer_forward_flops(hidden_size, seq_length, tokens,
                                                                      ffn_hidden_size, moe=moe,
                                                                      attention_length=attention_length, **arch)
    return layers + 3 * logit_forward_flops(hidden_size, vocab_size, tokens)


def norm_parameters(hidden_size: int, normalization: str = "LayerNorm", norm_bias: bool = True) -> int:
    """One norm's parameters: LayerNorm's weight and bias (2h; h with ``--disable-bias-norm``), RMSNorm's
    weight (h)."""
    return hidden_size * (2 if normalization != "RMSNorm" and norm_bias else 1)


def layer_parameter_count(hidden_size: int, ffn_hidden_size: int | None = None, *,
                          num_attention_heads: int | None = None, num_query_groups: int | None = None,
                          kv_channels: int | None = None, swiglu: bool = False, bias: bool = True,
                          normalization: str = "LayerNorm", moe: MoEShape | None = None, active: bool = False,
                          norm_bias: bool = True) -> int:
    """Parameters of one layer: QKV + projection ``4h² + 4h``, MLP ``2·h·ffn + ffn + h``, 2 LayerNorms ``4h``.

    Equals the paper's ``12h² + 13h`` when ffn = 4h. Generally: attention ``h·(2q + 2k)`` weights (+ ``q +
    2k + h`` biases), MLP ``2·h·ffn`` or with SwiGLU ``3·h·ffn`` weights (+ ``ffn + h``, SwiGLU ``2·ffn +
    h`` biases), and two norms of ``2h`` (LayerNorm) or ``h`` (RMSNorm: no bias).
    """
    h, f = hidden_size, _ffn(hidden_size, ffn_hidden_size)
    q, k = _widths(h, num_attention_heads, num_query_groups, kv_channels)
    if moe is not None:  # an MoE layer: router, E (or, ``active``, k) bias-free experts, shared expert, gate
        mlp = _moe_mlp(h, moe, swiglu, moe.topk if active else moe.num_experts)[1]
        shared_biases = ((2 if swiglu else 1) * moe.shared_ffn + h) if moe.shared_ffn else 0
        return h * (2 * q + 2 * k) + mlp + ((q + 2 * k + h) + shared_biases if bias else 0) + \
            2 * norm_parameters(h, normalization, norm_bias)
    weights = h * (2 * q + 2 * k) + (3 if swiglu else 2) * h * f
    biases = (q + 2 * k + h) + ((2 if swiglu else 1) * f + h) if bias else 0
    norms = 2 * norm_parameters(h, normalization, norm_bias)
    return weights + biases + norms


def parameter_count(
    num_layers: int,
    hidden_size: int,
    seq_length: int,
    vocab_size: int,
    ffn_hidden_size: int | None = None,
    *,
    untied: bool = False,
    rope: bool = False,
    **layer: Any,
) -> int:
    """Parameters ``P = 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h))`` (ptdp-facts.md, §FLOPs).

    Layers plus word embeddings ``V·h`` (tied with the output layer) plus learned positions ``s·h``.
    Like the paper, the final LayerNorm (2h) is not counted. An untied output layer adds ``V·h``; rotary
    positions (``rope``) have no ``s·h`` table; ``layer`` goes to :func:`layer_parameter_count`.
    """
    embeddings = (2 if untied else 1) * vocab_size * hidden_size + (0 if rope else seq_length * hidden_size)
    moe = layer.pop("moe", None)
    active = layer.pop("active", False)
    dense = num_layers - (moe.moe_layers if moe else 0)
    layers = dense * layer_parameter_count(hidden_size, ffn_hidden_size, **layer)
    if moe is not None:
        layers += moe.moe_layers * layer_parameter_count(hidden_size, ffn_hidden_size, moe=moe, active=active, **layer)
    return layers + embeddings


def model_parameter_count(model: ModelShape, vocab_size: int | None = None, moe: MoEShape | None = None,
                          active: bool = False) -> int:
    """:func:`parameter_count` of a ``ModelConfig`` or ``GPTSpec`` (vocabulary ``model.vocab_size`` unless given,
    unpadded; final norm not counted); with ``moe`` all experts, or with ``active`` those a token uses."""
    vocab = vocab_size or model.vocab_size
    if vocab is None:
        raise ValueError("model_parameter_count needs a vocabulary size: the model's has none")
    return parameter_count(
        model.num_layers, model.hidden_size, model.seq_length, vocab, model.ffn_size,
        untied=model.untie_embeddings_and_output_weights, rope=model.position_embedding_type == "rope",
        bias=not model.disable_bias_linear, normalization=model.normalization,
        norm_bias=not model.disable_bias_norm, moe=moe, active=active,
        **architecture(model))
