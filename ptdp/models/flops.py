"""Model FLOPs and parameter counts of a GPT, exactly as the PTD-P paper counts them.

See docs/references.md, §FLOPs (the paper's Appendix, eq. 3). The trainer calls ``flops_per_iteration`` every
iteration to report TFLOP/s per GPU, so everything here is closed-form integer arithmetic.

Where the paper assumes ``ffn_hidden_size = 4h`` we keep its structure and only replace the MLP term, so
the general formulas reduce *exactly* to eq. (3) when ``ffn = 4h``:

* per layer forward, ``2·(matmul FLOPs)`` per multiply-add:
  QKV projection ``6·B·s·h²`` + attention output projection ``2·B·s·h²`` + MLP ``4·B·s·h·ffn``
  (two GEMMs of ``h × ffn``) + attention scores and weighted values ``4·B·s²·h``.
  With ``ffn = 4h`` that is the paper's ``24·B·s·h² + 4·B·s²·h``.
* logits: ``2·B·s·h·V`` forward.
* packed documents with ``--reset-attention-mask`` (docs/references.md, §Packed sequences): attention is
  computed inside each document only, so a sample's scores-and-values term ``4·s²·h`` becomes
  ``4·(sum of l_i²)·h`` over its documents' lengths l_i: ``attention_length`` is that sum divided by s
  (averaged over the samples; s itself for whole windows), and the term is ``4·B·s·attention_length·h``.
* sliding-window layers (``--window-size``) attend to min(w, s) keys per query, not s:
  :func:`windowed_attention_length` is the mean over the layers, passed as ``attention_length``.
* a backward pass costs twice its forward; full activation recomputation runs the layers' forward once
  more (the logit layer is not recomputed), hence the factor 4 (= 96/24) or 3 (= 72/24) on layer terms
  and always 3 on the logit term.

Llama-family options (keyword arguments, all defaulting to GPT-2; docs/references.md, §Llama-family layers),
with ``q = a·d`` query/output width (``d`` = ``kv_channels``, default h/a, so q = h) and ``k = G·d`` the key
and value width of G query groups (G = a without GQA):

* attention projections ``2·B·s·h·(2q + 2k)``: Q and output ``h × q`` each, K and V ``h × k`` each;
  with q = h, k = h·G/a that is ``2·B·s·h·(2h + 2h·G/a)``;
* scores and values ``4·B·s²·q``;
* SwiGLU MLP ``6·B·s·h·ffn`` (gate, up and down, three ``h × ffn`` GEMMs) instead of ``4·B·s·h·ffn``;
* RMSNorm, rotary embeddings and the element-wise ops are not counted (as LayerNorm and GeLU are not);
  an untied output layer costs the same logit FLOPs as a tied one.

Mixture of experts (``moe``, a :class:`MoEShape`): FLOPs and "active" parameters count what a token
goes through -- the router ``2·B·s·h·E``, its k experts' MLPs (``k`` times the MLP term with the experts'
hidden size), the shared expert's MLP and its gate ``2·B·s·h`` -- in the ``moe_layers`` MoE layers; the total
parameter count holds all E experts.

Multi-latent attention (``mla``, an :class:`MLAShape`) replaces the attention projections by its
five (``MLAShape.projections``: the down and up projections of queries and keys/values, and the output), and
the scores and weighted values by ``2·B·s²·a·(d_k + d_r)`` and ``2·B·s²·a·d_v``; its two latent norms add
parameters. Multi-token prediction (``mtp_num_layers`` D) adds per module a transformer layer (MoE when the
last layer is), its ``eh_proj`` ``2·B·s·2h·h`` and a logit layer, and ``2h² + 3`` norms of parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ptdp.models.flops_linear import LinearShape, linear_shape, mixer_flops_delta, mixer_parameters_delta


@dataclass(frozen=True)
class MoEShape:
    """What the counts need of a mixture of experts: E, k, the experts' and the shared expert's hidden sizes,
    whether the shared expert is gated, how many layers are MoE and whether the last one is (the MTP modules'
    layers are like it)."""

    num_experts: int
    topk: int
    ffn: int
    moe_layers: int
    shared_ffn: int = 0
    shared_gate: bool = False
    last_layer_sparse: bool = True


@dataclass(frozen=True)
class MLAShape:
    """Multi-latent attention's sizes (``ModelConfig``'s names; ``ptdp.models.mla``)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int

    def projections(self, h: int, a: int) -> list[tuple[int, int, bool]]:
        """(output, input, split by heads under tensor parallelism) of each projection GEMM, in order."""
        dk, dr, dv, r = self.qk_head_dim, self.qk_pos_emb_head_dim, self.v_head_dim, self.kv_lora_rank
        q = a * (dk + dr)
        query = [(q, h, True)] if self.q_lora_rank is None else [(self.q_lora_rank, h, False),
                                                                  (q, self.q_lora_rank, True)]
        return query + [(r + dr, h, False), (a * (dk + dv), r, True), (h, a * dv, True)]

    def weights(self, h: int, a: int) -> int:
        return sum(out * inp for out, inp, _ in self.projections(h, a))

    def norms(self) -> int:
        """The latent norms' weights (RMSNorm)."""
        return (self.q_lora_rank or 0) + self.kv_lora_rank

    def biases(self, h: int, a: int) -> int:
        return sum(out for out, _, _ in self.projections(h, a))

    def replicated(self, h: int, a: int, bias: bool, norm_width: int = 1) -> int:
        """Parameters a tensor-parallel split by heads leaves whole on every rank: the down projections
        (with their biases) and the latent norms (``norm_width`` 2 for LayerNorm: weight and bias)."""
        down = sum(out * (inp + bias) for out, inp, split in self.projections(h, a) if not split)
        return down + self.norms() * norm_width

    def latent_width(self) -> int:
        """Activations the latents keep per token (elements): the down projections' outputs and their norms'."""
        return 2 * (self.q_lora_rank or 0) + 2 * self.kv_lora_rank + self.qk_pos_emb_head_dim


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
    @property
    def multi_latent_attention(self) -> bool: ...
    @property
    def q_lora_rank(self) -> int | None: ...
    @property
    def kv_lora_rank(self) -> int: ...
    @property
    def qk_head_dim(self) -> int: ...
    @property
    def qk_pos_emb_head_dim(self) -> int: ...
    @property
    def v_head_dim(self) -> int: ...
    @property
    def mtp_num_layers(self) -> int | None: ...


def mla_shape(model: ModelShape) -> MLAShape | None:
    """The :class:`MLAShape` of a ``ModelConfig`` or a planner ``GPTSpec``; None without MLA."""
    if not model.multi_latent_attention:
        return None
    return MLAShape(model.q_lora_rank, model.kv_lora_rank, model.qk_head_dim, model.qk_pos_emb_head_dim,
                    model.v_head_dim)


def moe_shape(model: Any, moe: Any) -> MoEShape | None:
    """The :class:`MoEShape` of a ``ModelConfig`` and ``MoEConfig`` (None: dense)."""
    if moe is None or not moe.num_experts:
        return None
    from ptdp.config.validate_moe import moe_layer_pattern

    pattern = moe_layer_pattern(moe.moe_layer_freq, model.num_layers)
    return MoEShape(moe.num_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size or model.ffn_size, sum(pattern),
                    moe.moe_shared_expert_intermediate_size or 0, moe.moe_shared_expert_gate, pattern[-1])


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
        # a gated MLP (SwiGLU or Gemma's GeGLU): three ffn matrices
        "kv_channels": model.kv_channels, "swiglu": getattr(model, "gated_mlp", model.swiglu),
        "mla": mla_shape(model), "linear": linear_shape(model),
    }


def windowed_attention_length(model: Any, attended: float | None = None) -> float | None:
    """The keys a query attends to, averaged over the layers, when some layers slide (``--window-size``): a
    windowed layer's scores-and-values term is ``4·B·s·min(w, s)·q``, a full layer's ``4·B·s·s·q``, so the
    mean over the layers of min(w_i, s) in place of s counts every layer's attention exactly. None when no
    layer slides (``attended``: the key length otherwise, default s)."""
    if not getattr(model, "window_size", None):
        return None
    from ptdp.config.validate_window import window_layers

    keys = model.seq_length if attended is None else attended
    windows = window_layers(model)
    return sum(keys if w is None else min(w, keys) for w in windows) / len(windows)


def window_layer_costs(model: Any) -> list[float] | None:
    """Per layer, its forward FLOPs over a whole-context layer's (1.0 for a global layer, below it for a
    sliding one: min(w, s) keys per query in the attention term), so that ``ptdp simulate`` prices a windowed
    stage by its windows; None when no layer slides. ``model``: a ``ModelConfig`` (its ``ffn_size``)."""
    if not getattr(model, "window_size", None):
        return None
    from ptdp.config.validate_window import window_layers

    h, s, arch = model.hidden_size, model.seq_length, architecture(model)
    full = layer_forward_flops(h, s, s, model.ffn_size, **arch)
    return [1.0 if w is None else layer_forward_flops(h, s, s, model.ffn_size, attention_length=min(w, s),
                                                      **arch) / full for w in window_layers(model)]


def mtp_layers(model: ModelShape) -> int:
    """The multi-token prediction modules D of a ``ModelConfig`` or ``GPTSpec`` (0: none)."""
    return model.mtp_num_layers or 0


def layer_forward_flops(hidden_size: int, seq_length: int, tokens: int, ffn_hidden_size: int | None = None, *,
                        num_attention_heads: int | None = None, num_query_groups: int | None = None,
                        kv_channels: int | None = None, swiglu: bool = False, moe: MoEShape | None = None,
                        mla: MLAShape | None = None, attention_length: float | None = None,
                        linear: LinearShape | None = None) -> int:
    """Forward FLOPs of one transformer layer for ``tokens`` = B·s tokens of sequence length s.

    ``(2h·(2q + 2k) + mlp·h·ffn + 4·s·q)·B·s`` with mlp = 4 (GeLU) or 6 (SwiGLU); for GPT-2 (q = k = h)
    ``(8·h² + 4·h·ffn + 4·s·h)·B·s``, the paper's ``24·B·s·h² + 4·B·s²·h`` when ffn = 4h. With ``mla`` the
    attention is ``2·(MLA projections) + 2·s·a·(d_k + d_r + d_v)`` per token. Packed documents:
    ``attention_length`` (sum of l_i² / s, module docstring) replaces s in the attention term. ``linear``:
    Gated DeltaNet layers and gated attention, averaged over the layers (``ptdp.models.flops_linear``).
    """
    h, f = hidden_size, _ffn(hidden_size, ffn_hidden_size)
    q, k = _widths(h, num_attention_heads, num_query_groups, kv_channels)
    mlp = (6 if swiglu else 4) * h * f if moe is None else 2 * _moe_mlp(h, moe, swiglu, moe.topk)[0]
    attended = seq_length if attention_length is None else attention_length
    if mla is not None:
        a = num_attention_heads
        scores = 2 * attended * a * (mla.qk_head_dim + mla.qk_pos_emb_head_dim + mla.v_head_dim)
        return int(tokens * (2 * mla.weights(h, a) + mlp) + round(tokens * scores))
    return (int(tokens * (2 * h * (2 * q + 2 * k) + mlp) + round(tokens * 4 * attended * q))
            + mixer_flops_delta(linear, h, q, k, attended, tokens))


def _mtp_forward_flops(hidden_size: int, seq_length: int, tokens: int, ffn_hidden_size: int | None,
                       moe: MoEShape | None, arch: dict[str, Any]) -> int:
    """Forward FLOPs of one MTP module without its logits: its ``eh_proj`` and its transformer layer."""
    sparse = moe if moe is not None and moe.last_layer_sparse else None
    eh_proj = 2 * tokens * 2 * hidden_size * hidden_size
    return eh_proj + layer_forward_flops(hidden_size, seq_length, tokens, ffn_hidden_size, moe=sparse, **arch)


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
    mtp_num_layers: int = 0,
    attention_length: float | None = None,
    **arch: Any,
) -> int:
    """FLOPs of one training iteration (forward + backward [+ recomputed forward]) over the global batch.

    With ``recompute=True`` (full activation recomputation) and ffn = 4h this is the paper's eq. (3),
    ``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))``; without it the layer terms get 72 instead of 96 and the
    logit term stays ``6·B·s·h·V`` (docs/references.md, §FLOPs). Selective recomputation re-runs only the
    attention core; like Megatron we do not count it (pass ``recompute=False``). ``attention_length``:
    packed documents' attention (module docstring).
    """
    tokens = global_batch_size * seq_length
    layer_passes = 4 if recompute else 3
    moe, mtp = arch.pop("moe", None), mtp_num_layers
    dense = num_layers - (moe.moe_layers if moe else 0)
    layers = dense * layer_passes * layer_forward_flops(hidden_size, seq_length, tokens, ffn_hidden_size,
                                                        attention_length=attention_length, **arch)
    if moe is not None:
        layers += moe.moe_layers * layer_passes * layer_forward_flops(hidden_size, seq_length, tokens,
                                                                      ffn_hidden_size, moe=moe,
                                                                      attention_length=attention_length, **arch)
    if mtp:  # each MTP module: eh_proj, a layer (recomputed like the others) and one more logit layer
        layers += mtp * layer_passes * _mtp_forward_flops(hidden_size, seq_length, tokens, ffn_hidden_size, moe,
                                                          dict(arch, attention_length=attention_length))
    return layers + 3 * (1 + mtp) * logit_forward_flops(hidden_size, vocab_size, tokens)


def norm_parameters(hidden_size: int, normalization: str = "LayerNorm", norm_bias: bool = True) -> int:
    """One norm's parameters: LayerNorm's weight and bias (2h; h with ``--disable-bias-norm``), RMSNorm's
    weight (h)."""
    return hidden_size * (2 if normalization != "RMSNorm" and norm_bias else 1)


def layer_parameter_count(hidden_size: int, ffn_hidden_size: int | None = None, *,
                          num_attention_heads: int | None = None, num_query_groups: int | None = None,
                          kv_channels: int | None = None, swiglu: bool = False, bias: bool = True,
                          normalization: str = "LayerNorm", moe: MoEShape | None = None, active: bool = False,
                          norm_bias: bool = True, mla: MLAShape | None = None,
                          linear: LinearShape | None = None) -> int:
    """Parameters of one layer: QKV + projection ``4h² + 4h``, MLP ``2·h·ffn + ffn + h``, 2 LayerNorms ``4h``.

    Equals the paper's ``12h² + 13h`` when ffn = 4h. Generally: attention ``h·(2q + 2k)`` weights (+ ``q +
    2k + h`` biases; with ``mla`` its projections, their biases and its two latent norms), MLP ``2·h·ffn``
    or with SwiGLU ``3·h·ffn`` weights (+ ``ffn + h``, SwiGLU ``2·ffn + h`` biases), and two norms of ``2h``
    (LayerNorm) or ``h`` (RMSNorm: no bias).
    """
    h, f = hidden_size, _ffn(hidden_size, ffn_hidden_size)
    q, k = _widths(h, num_attention_heads, num_query_groups, kv_channels)
    if mla is not None:
        attention = mla.weights(h, num_attention_heads) + mla.norms() * norm_parameters(1, normalization, norm_bias)
        attention_biases = mla.biases(h, num_attention_heads) - h  # the output bias is counted below
    else:
        attention, attention_biases = h * (2 * q + 2 * k), q + 2 * k
    norms = 2 * norm_parameters(h, normalization, norm_bias) + mixer_parameters_delta(linear, h, q, k)
    if moe is not None:  # an MoE layer: router, E (or, ``active``, k) bias-free experts, shared expert, gate
        mlp = _moe_mlp(h, moe, swiglu, moe.topk if active else moe.num_experts)[1]
        shared_biases = ((2 if swiglu else 1) * moe.shared_ffn + h) if moe.shared_ffn else 0
        return attention + mlp + ((attention_biases + h) + shared_biases if bias else 0) + norms
    weights = attention + (3 if swiglu else 2) * h * f
    biases = (attention_biases + h) + ((2 if swiglu else 1) * f + h) if bias else 0
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
    mtp_num_layers: int = 0,
    **layer: Any,
) -> int:
    """Parameters ``P = 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h))`` (docs/references.md, §FLOPs).

    Layers plus word embeddings ``V·h`` (tied with the output layer) plus learned positions ``s·h``.
    Like the paper, the final LayerNorm (2h) is not counted. An untied output layer adds ``V·h``; rotary
    positions (``rope``) have no ``s·h`` table; ``layer`` goes to :func:`layer_parameter_count`.
    """
    embeddings = (2 if untied else 1) * vocab_size * hidden_size + (0 if rope else seq_length * hidden_size)
    moe = layer.pop("moe", None)
    active = layer.pop("active", False)
    mtp = mtp_num_layers
    dense = num_layers - (moe.moe_layers if moe else 0)
    layers = dense * layer_parameter_count(hidden_size, ffn_hidden_size, **layer)
    if moe is not None:
        layers += moe.moe_layers * layer_parameter_count(hidden_size, ffn_hidden_size, moe=moe, active=active, **layer)
    if mtp:  # per module: a layer like the last one, eh_proj [h, 2h] and three norms
        sparse = moe if moe is not None and moe.last_layer_sparse else None
        norm = norm_parameters(hidden_size, layer.get("normalization", "LayerNorm"), layer.get("norm_bias", True))
        layers += mtp * (layer_parameter_count(hidden_size, ffn_hidden_size, moe=sparse, active=active, **layer)
                         + 2 * hidden_size * hidden_size + 3 * norm)
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
        norm_bias=not model.disable_bias_norm, moe=moe, active=active, mtp_num_layers=mtp_layers(model),
        **architecture(model))
