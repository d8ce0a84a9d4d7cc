"""What the planner plans for: the model, the cluster, the training setup, and one parallel layout.

Vocabulary follows Megatron-Core and ptdp-facts.md: t tensor, p pipeline, d data parallel size, v model
chunks per pipeline rank, b micro-batch size, m = B/(b·d) microbatches per pipeline per iteration.
"""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.hardware import Accelerator, accelerator

RECOMPUTE_CHOICES = ("none", "selective", "full")


@dataclass(frozen=True)
class GPTSpec:
    """Shape of a GPT (learned positions, tied embeddings, 4h MLP unless ``ffn_hidden_size`` says otherwise)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    ffn_hidden_size: int | None = None

    @property
    def ffn(self) -> int:
        return 4 * self.hidden_size if self.ffn_hidden_size is None else self.ffn_hidden_size


GPT3_175B = GPTSpec(num_layers=96, hidden_size=12288, num_attention_heads=96, seq_length=2048, vocab_size=51200)
MODEL_PRESETS: dict[str, GPTSpec] = {"gpt3-175b": GPT3_175B}


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
        """A cluster of a table GPU (``ptdp.hardware``); None keeps the server's default."""
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
    18 bytes/param); see ptdp-facts.md, §Memory. ``overlap_grad_reduce``: start the data-parallel gradient
    reduction during the last microbatch's backward (modern Megatron); the paper's runs did not.
    """

    global_batch_size: int
    precision: str = "fp16"
    overlap_grad_reduce: bool = False


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

    @property
    def schedule(self) -> str:
        """Pipeline schedule the layout runs with: 1F1B, or Megatron's interleaved 1F1B when v > 1."""
        return "interleaved" if self.virtual_pipeline_model_parallel_size > 1 else "1f1b"

    def num_microbatches(self, global_batch_size: int) -> int:
        return global_batch_size // (self.micro_batch_size * self.data_parallel_size)
