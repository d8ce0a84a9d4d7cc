"""What the planner plans for: the model, the cluster, the training setup, and one parallel layout.

Vocabulary follows Megatron-Core and docs/references.md, §Notation: t tensor, p pipeline, d data parallel size, v model
chunks per pipeline rank, b micro-batch size, m = B/(b·d) microbatches per pipeline per iteration.
"""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.config import ModelConfig
from ptdp.config.schema import effective_sharding
from ptdp.models.flops import MLAShape, MoEShape, mla_shape, model_parameter_count, windowed_attention_length
from ptdp.models.flops_linear import LinearShape, linear_shape
from ptdp.runtime.hardware import Accelerator, accelerator
from ptdp.schedule.registry import default_schedule

RECOMPUTE_CHOICES = ("none", "selective", "full")


@dataclass(frozen=True)
class GPTSpec:
    """The planner's frozen view of ``ptdp train``'s ``ModelConfig`` (``from_model_config``): shape of a GPT (learned positions, tied embeddings, 4h MLP unless ``ffn_hidden_size`` says otherwise).

    The Llama-family fields carry ``ModelConfig``'s names (so ``ptdp.models.flops.architecture`` reads both):
    ``num_query_groups`` G for grouped-query attention (None: one K/V head per query head), ``kv_channels``
    the head dimension (None: h/a), ``swiglu`` three ffn matrices, an untied output layer, RMSNorm, rotary
    positions (no s·h table) and no linear biases.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    ffn_hidden_size: int | None = None
    num_query_groups: int | None = None
    kv_channels: int | None = None
    swiglu: bool = False
    untie_embeddings_and_output_weights: bool = False
    normalization: str = "LayerNorm"
    position_embedding_type: str = "learned_absolute"
    disable_bias_linear: bool = False
    disable_bias_norm: bool = False  # LayerNorm without bias (no effect on RMSNorm, which has none)
    moe: MoEShape | None = None  # a mixture of experts: FLOPs count the active experts (ptdp.models.flops)
    # packed documents (--reset-attention-mask): sum of l_i^2 / s per sample, the keys a query's attention
    # spans in FLOPs, time and score memory (ptdp.models.flops); sliding windows (--window-size): the mean
    # over the layers of min(w, s); None: whole windows (s)
    attention_length: float | None = None
    multi_latent_attention: bool = False  # MLA with ModelConfig's sizes
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    mtp_num_layers: int = 0  # multi-token prediction modules, on the last pipeline stage
    # Gated DeltaNet layers and the attention output gate (Qwen3-Next): priced by their own FLOPs, linear in s
    linear: LinearShape | None = None

    @property
    def attended(self) -> float:
        """What stands for the key length s in the attention terms: s, or the documents' ``attention_length``."""
        return self.seq_length if self.attention_length is None else self.attention_length

    @property
    def mla(self) -> MLAShape | None:
        """Multi-latent attention's sizes (None: standard attention)."""
        return mla_shape(self)

    @property
    def ffn(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.swiglu else 4 * self.hidden_size

    @property
    def ffn_size(self) -> int:
        """``ffn`` under ``ModelConfig``'s name: the FLOP counts read both (``ptdp.models.flops.ModelShape``)."""
        return self.ffn

    def parameter_count(self, active: bool = False) -> int:
        """All parameters (the embeddings, the final norm not counted), or with ``active`` those a token
        goes through (a mixture of experts' k routed experts)."""
        return model_parameter_count(self, moe=self.moe, active=active)

    def _moe_ffn(self, experts_per_token: bool) -> float:
        """The MLP width of the mean layer: a MoE layer's experts (k of them, or all E) plus its shared expert."""
        if self.moe is None:
            return self.ffn
        m = self.moe
        sparse = (m.topk if experts_per_token else m.num_experts) * m.ffn + m.shared_ffn
        return ((self.num_layers - m.moe_layers) * self.ffn + m.moe_layers * sparse) / self.num_layers

    @property
    def active_ffn(self) -> float:
        """MLP width a token goes through, per layer on average (= ffn for a dense model): time, activations."""
        return self._moe_ffn(True)

    @property
    def parameter_ffn(self) -> float:
        """MLP width holding the parameters, per layer on average (all experts). Per rank the planner counts
        a MoE model's layers with ``planner/experts.py`` instead (experts over e·etp, router replicated)."""
        return self._moe_ffn(False)

    @property
    def group_query_attention(self) -> bool:
        return self.num_query_groups is not None

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def q_width(self) -> int:
        """a·d: the query (and attention output) projection width; with MLA, a·(d_k + d_r)."""
        if self.mla is not None:
            return self.num_attention_heads * (self.mla.qk_head_dim + self.mla.qk_pos_emb_head_dim)
        return self.num_attention_heads * (self.kv_channels or self.hidden_size // self.num_attention_heads)

    @property
    def kv_width(self) -> int:
        """G·d: the key (and the value) projection width. With MLA the activations' and traffic's stand-in:
        (K + V + the output projection's input) = 2·q_width + 2·kv_width wide as for GQA, kv_width = a·d_v
        (keys are a·(d_k + d_r), values and the output's input a·d_v each)."""
        if self.mla is not None:
            return self.num_attention_heads * self.mla.v_head_dim
        return self.query_groups * (self.kv_channels or self.hidden_size // self.num_attention_heads)

    @property
    def mla_replicated(self) -> int:
        """A multi-latent attention layer's parameters that stay whole under tensor parallelism (0 without
        MLA): the down projections and the latent norms (Megatron-Core splits the others by heads)."""
        if self.mla is None:
            return 0
        norm_width = 1 if self.normalization == "RMSNorm" else 2
        return self.mla.replicated(self.hidden_size, self.num_attention_heads, not self.disable_bias_linear,
                                   norm_width)

    @classmethod
    def from_model_config(cls, m: ModelConfig) -> GPTSpec:
        """The shape of ``ptdp train``'s model configuration (the flags ``ptdp plan`` shares with it)."""
        return cls(
            num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
            seq_length=m.seq_length, vocab_size=m.vocab_size, ffn_hidden_size=m.ffn_hidden_size,
            num_query_groups=m.num_query_groups if m.group_query_attention else None, kv_channels=m.kv_channels,
            swiglu=m.gated_mlp, untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
            normalization=m.normalization, position_embedding_type=m.position_embedding_type,
            disable_bias_linear=m.disable_bias_linear, disable_bias_norm=m.disable_bias_norm,
            multi_latent_attention=m.multi_latent_attention, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
            qk_head_dim=m.qk_head_dim, qk_pos_emb_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
            mtp_num_layers=m.mtp_num_layers or 0, attention_length=windowed_attention_length(m),
            linear=linear_shape(m),
        )

    @classmethod
    def from_preset(cls, values: dict) -> GPTSpec:
        """The shape of a ``ptdp.config.presets`` entry (which holds ``ModelConfig`` field values)."""
        return cls.from_model_config(ModelConfig(**values))


def _published_presets() -> dict[str, GPTSpec]:
    import dataclasses

    from ptdp.config import MoEConfig
    from ptdp.config.presets import MODEL_PRESETS as ALL
    from ptdp.config.presets import MOE_PRESETS
    from ptdp.models.flops import moe_shape

    specs = {name: GPTSpec.from_preset(values) for name, values in ALL.items() if "vocab_size" in values}
    for name in specs.keys() & MOE_PRESETS.keys():  # the experts: FLOPs count the active ones
        specs[name] = dataclasses.replace(specs[name], moe=moe_shape(ModelConfig(**ALL[name]),
                                                                     MoEConfig(**MOE_PRESETS[name])))
    return specs


MODEL_PRESETS: dict[str, GPTSpec] = _published_presets()
GPT3_175B = MODEL_PRESETS["gpt3-175b"]


@dataclass(frozen=True)
class ClusterSpec:
    """``num_gpus`` accelerators in servers of ``gpus_per_node``; bandwidths per GPU per direction (bytes/s)."""

    gpu: Accelerator
    num_gpus: int
    gpus_per_node: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float

    @classmethod
    def of(
        cls,
        gpu: str,
        num_gpus: int,
        gpus_per_node: int | None = None,
        intra_node_bandwidth: float | None = None,
        inter_node_bandwidth: float | None = None,
    ) -> ClusterSpec:
        """A cluster of a table GPU (``ptdp.runtime.hardware``); None keeps the server's default."""
        acc = accelerator(gpu)
        return cls(
            gpu=acc,
            num_gpus=num_gpus,
            gpus_per_node=gpus_per_node or acc.gpus_per_node,
            intra_node_bandwidth=intra_node_bandwidth or acc.intra_node_bandwidth,
            inter_node_bandwidth=inter_node_bandwidth or acc.inter_node_bandwidth,
        )


@dataclass(frozen=True)
class TrainingSpec:
    """Per-iteration workload and numerics.

    ``precision``: "fp16" (the paper: fp16 grads, 20 bytes/param) or "bf16" (Megatron: fp32 main grads,
    18 bytes/param); see docs/references.md, §Memory. ``optimizer``: an ``--optimizer`` name, whose state bytes per
    parameter are its ``ptdp.config.optimizers.OptimizerSpec``'s (AdamW 8, its two moments; SGD and Muon's
    hidden matrices 4, one momentum; docs/references.md, §Muon). ``overlap_grad_reduce``: start the data-parallel gradient
    reduction during the last microbatch's backward (modern Megatron); the paper's runs did not.
    """

    global_batch_size: int
    precision: str = "fp16"
    overlap_grad_reduce: bool = False
    optimizer: str = "adam"  # --optimizer: a name of ptdp.config.optimizers.REGISTRY


@dataclass(frozen=True)
class ParallelConfig:
    """One point of the search space."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    virtual_pipeline_model_parallel_size: int = 1
    micro_batch_size: int = 1
    recompute_granularity: str = "none"  # "none" | "selective" | "full"
    use_distributed_optimizer: bool = False
    sequence_parallel: bool = False
    pipeline_schedule: str | None = None  # None: 1f1b, or interleaved when v > 1
    context_parallel_size: int = 1  # c: each sample's sequence over c ranks (world = t·c·d·p)
    cp_comm_type: str = "p2p"  # ring attention (p2p), Ulysses (a2a) or allgather
    # an uneven layout (Megatron's layout string; None: even) and vocabulary parallelism
    pipeline_model_parallel_layout: str | None = None
    enable_vocab_parallel: bool = False
    disable_fb_fusion: bool = False  # with enable_vocab_parallel: two barriers per microbatch
    # ZeRO stage (--data-parallel-sharding-strategy; use_distributed_optimizer alone means "optim") and
    # hybrid sharding (--num-distributed-optimizer-instances K: shards over d·c/K ranks, K replicas)
    sharding_strategy: str = "no_shard"
    distributed_optimizer_instances: int = 1
    # a mixture of experts: e, etp (None: t, as Megatron-Core) and the dispatcher (planner/experts.py)
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    moe_token_dispatcher_type: str = "allgather"  # ptdp train's (and Megatron-LM's) default
    # combined 1F1B (1f1b, interleaved); dualpipev overlaps by itself (planner/perf.py prices both)
    overlap_moe_expert_parallel_comm: bool = False

    @property
    def strategy(self) -> str:
        """The effective ZeRO strategy, as ``OptimizerConfig.sharding`` derives it for ``ptdp train``."""
        return effective_sharding(self.sharding_strategy, self.use_distributed_optimizer)

    @property
    def shards(self) -> int:
        """How many ranks split what the strategy shards: the dp-cp group, or one hybrid instance of it."""
        if self.strategy == "no_shard":
            return 1
        return self.data_parallel_size * self.context_parallel_size // self.distributed_optimizer_instances

    @property
    def schedule(self) -> str:
        """Pipeline schedule the layout runs with: ``pipeline_schedule`` when set, else 1F1B, or Megatron's
        interleaved 1F1B when v > 1 (``ptdp.schedule.registry.default_schedule``, as ``ptdp train``)."""
        return default_schedule(self.pipeline_schedule, self.virtual_pipeline_model_parallel_size)

    def num_microbatches(self, global_batch_size: int) -> int:
        return global_batch_size // (self.micro_batch_size * self.data_parallel_size)
