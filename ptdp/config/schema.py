"""The configuration tree of a training run: one dataclass per section, one field per flag.

Every field carries its Megatron-LM flag name in its metadata; the ``ptdp train`` parser, the
``--config FILE.toml`` reader (``ptdp.config.load``, same keys as the flags, dashes or underscores), the
planner's and simulator's flags and the validation (``ptdp.config.validate``) all come from these
dataclasses, so a flag is declared exactly once. Nothing here checks or derives: see ``validate`` (every
problem, pure) and ``derive`` (resolved values, a new object).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ptdp.config import optimizers
from ptdp.config.fields import DELAY_WGRAD_HELP, OVERLAP_HELP, opt, schedule_help
from ptdp.config.fields import ConfigError as ConfigError  # re-exported: the checks raise it from here
from ptdp.config.model import ModelConfig as ModelConfig  # re-exported: one section per module where it grew
from ptdp.schedule.registry import REGISTRY, default_schedule, default_virtual_size


@dataclass
class MoEConfig:
    """Mixture of experts (Megatron-Core's flags; ``ptdp.models.moe``, docs/moe.md). Off while
    ``--num-experts`` is unset."""

    num_experts: int | None = opt(None, "experts E per MoE layer (unset: dense MLPs)")
    moe_router_topk: int = opt(2, "experts k each token is routed to")
    moe_ffn_hidden_size: int | None = opt(None, "hidden size of each expert's MLP (default --ffn-hidden-size)")
    moe_layer_freq: str = opt("1", "which layers are MoE: N (every Nth layer, from layer 0) or a list such as "
                              "'[1,0,1,0]' or '([1]*3+[0])*2' (one entry per layer)")
    moe_shared_expert_intermediate_size: int | None = opt(
        None, "hidden size of a shared expert every token also goes through (Qwen2-MoE, DeepSeek)")
    moe_shared_expert_gate: bool = opt(False, "scale the shared expert's output by sigmoid(x·w_g) (Qwen2-MoE)")
    moe_router_load_balancing_type: str = opt(
        "aux_loss", "load-balancing loss: aux_loss (Switch, over the micro-batch), seq_aux_loss (per "
        "sequence) or none", choices=["aux_loss", "seq_aux_loss", "none"])
    moe_aux_loss_coeff: float = opt(0.0, "coefficient alpha of the load-balancing loss alpha*E*sum_i f_i*P_i")
    moe_z_loss_coeff: float | None = opt(None, "coefficient of the router z-loss mean(logsumexp(logits)^2)")
    moe_router_pre_softmax: bool = opt(False, "softmax over all E experts, then top-k (no renormalisation); "
                                       "default: top-k logits, then softmax over the k (Mixtral)")
    moe_expert_capacity_factor: float | None = opt(
        None, "each expert takes at most ceil(factor*k*tokens/E) tokens, the lowest-probability rest is "
        "dropped (default: dropless)")
    moe_pad_expert_input_to_capacity: bool = opt(
        False, "pad every expert's input to its capacity (needs --moe-expert-capacity-factor)")
    moe_token_dispatcher_type: str = opt("allgather", "how tokens reach experts on other ranks (expert "
                                         "parallelism): alltoall or allgather", choices=["alltoall", "allgather"])
    moe_grouped_gemm: bool = opt(False, "one grouped GEMM over the local experts (torch._grouped_mm) instead "
                                 "of a loop over experts")
    moe_router_score_function: str = opt("softmax", "router scores (DeepSeek-V3: sigmoid)",
                                         choices=["softmax", "sigmoid"])
    moe_router_enable_expert_bias: bool = opt(False, "aux-loss-free balancing: b += rate*sign(mean - load)")
    moe_router_bias_update_rate: float = opt(1e-3, "the expert bias update rate (DeepSeek-V3's 1e-3)")
    moe_router_num_groups: int | None = opt(None, "group-limited routing: the experts in this many equal groups")
    moe_router_group_topk: int | None = opt(None, "group-limited routing: the groups a token may use (top scores)")
    moe_router_topk_scaling_factor: float | None = opt(None, "the k routing weights times this (DeepSeek-V3: 2.5)")
    moe_linear_bias: bool = opt(False, "a bias on the router logits and on every expert's fc1 and fc2 (GPT-OSS; "
                                "the experts stay bias-free otherwise, whatever --disable-bias-linear)")


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = opt(1, "tensor-parallel size t (ranks adjacent, inside a node)")
    pipeline_model_parallel_size: int = opt(1, "pipeline-parallel size p")
    virtual_pipeline_model_parallel_size: int | None = opt(None, "model chunks per pipeline rank v")
    num_layers_per_virtual_pipeline_stage: int | None = opt(None, "Megatron's alternative way to set v")
    pipeline_schedule: str | None = opt(None, schedule_help(), choices=list(REGISTRY))
    scatter_gather_tensors_in_pipeline: bool = opt(
        True, "send 1/t of each boundary tensor and all-gather it in the TP group",
        flag="--no-scatter-gather-tensors-in-pipeline")
    distributed_timeout_minutes: float = opt(10.0, "process-group timeout, so a lost peer fails fast")
    hang_timeout_s: float = opt(300.0, "a rank without progress for this long is a hang: every rank's last "
                                "communication operations are written to DIR.run beside --save DIR, the stopped "
                                "rank(s) named, and the job exits so the launcher restarts it (0 disables)")
    fault_tolerant_replicas: int = opt(1, "split the data-parallel ranks into R replica groups, each its own job, "
                                       "averaging gradients through torchft's quorum: a failed group leaves it "
                                       "while the others go on (docs/fault-tolerance.md)")
    fault_tolerant_timeout_s: float = opt(60.0, "with --fault-tolerant-replicas: how long a cross-replica "
                                          "all-reduce, commit or quorum may take before its group is dropped")
    sequence_parallel: bool = opt(False, "split LayerNorm and dropout along the sequence across the TP group "
                                  "(needs t > 1)")
    context_parallel_size: int = opt(1, "context-parallel size c: each sample's sequence split over c ranks "
                                     "(2c load-balanced chunks; docs/context-parallel.md)")
    cp_comm_type: str = opt("p2p", "context-parallel attention: p2p (ring attention), a2a (Ulysses "
                            "all-to-all; local heads divisible by c) or allgather (all-gather K/V)",
                            choices=["p2p", "a2a", "allgather"])
    linear_attention_cp_comm_type: str = opt(
        "state_passing", "context parallelism of the Gated DeltaNet layers: state_passing (each rank sends its "
        "chunks' (A, B) state summaries and conv tails: bytes and memory flat in s) or a2a (head-parallel "
        "all-to-all; c divides the key heads)", choices=["state_passing", "a2a"])
    # Uneven pipeline layouts, Megatron-LM's flags and semantics (ptdp/schedule/layout.py, docs/pipeline-layout.md)
    decoder_first_pipeline_num_layers: int | None = opt(
        None, "transformer layers on the first pipeline rank (the rest split evenly over the middle ranks)")
    decoder_last_pipeline_num_layers: int | None = opt(
        None, "transformer layers on the last pipeline rank (the rest split evenly over the middle ranks)")
    account_for_embedding_in_pipeline_split: bool = opt(
        False, "count the input embedding as one layer of the even split (the first stage gets one layer fewer)")
    account_for_loss_in_pipeline_split: bool = opt(
        False, "count the output layer and loss as one layer of the even split (the last stage gets one fewer)")
    pipeline_model_parallel_layout: str | None = opt(
        None, "Megatron's layout string of the p x v virtual stages in pipeline order, e.g. 'Et|(tt|)*2,tL': "
        "E embedding, t layer, L loss, | between stages, *n repeats; sets v = stages / p")
    # Vocabulary parallelism: ptdp/schedule/vocab.py, docs/vocab-parallel.md
    enable_vocab_parallel: bool = opt(False, "split the input embedding and the output layer with its loss by "
                                      "vocabulary over all p pipeline ranks (and t within each), as S and T "
                                      "passes in the schedule (Yeung et al. 2024; docs/vocab-parallel.md)")
    disable_fb_fusion: bool = opt(False, "with --enable-vocab-parallel: two barriers per microbatch instead "
                                  "of one (in the paper: activation memory of p+1 microbatches against p+2)")
    expert_model_parallel_size: int = opt(1, "expert-parallel size e: the experts of each MoE layer split over e "
                                          "ranks, which may fold over the tensor- and context-parallel ranks "
                                          "(MoE Parallel Folding; docs/expert-parallel.md)")
    expert_tensor_parallel_size: int | None = opt(None, "tensor-parallel size of the experts: t (the "
                                                  "default, as Megatron-Core) or 1, which lets e span the "
                                                  "tensor-parallel ranks")
    # Overlapped forward-backward pairs: ptdp/schedule/dualpipe.py, docs/dualpipe.md
    overlap_moe_expert_parallel_comm: bool = opt(False, OVERLAP_HELP)
    delay_wgrad_compute: bool = opt(False, DELAY_WGRAD_HELP)

    @property
    def virtual_size(self) -> int:
        """Model chunks per rank: the V schedules (zbv, v-half, v-min) always hold two."""
        return self.virtual_pipeline_model_parallel_size or default_virtual_size(self.pipeline_schedule)

    @property
    def schedule(self) -> str:
        return default_schedule(self.pipeline_schedule, self.virtual_size)

    @property
    def vocab_barriers(self) -> int:
        """What ``ptdp.schedule.vocab`` takes: 0 without ``--enable-vocab-parallel``, else its barriers per
        microbatch (2 with ``--disable-fb-fusion``)."""
        if not self.enable_vocab_parallel:
            return 0
        return 2 if self.disable_fb_fusion else 1


@dataclass
class OptimizerConfig:
    lr: float = opt(6e-4, "peak learning rate")
    min_lr: float = opt(0.0, "learning rate at the end of the decay")
    lr_warmup_iters: int = opt(10, "linear warm-up iterations")
    lr_decay_style: str = opt("cosine", "decay after warm-up", choices=["cosine", "linear", "constant"])
    lr_decay_iters: int | None = opt(None, "iterations to decay over (default: --train-iters)")
    weight_decay: float = opt(0.1, "weight decay, not on biases and norms (decoupled for AdamW and Muon, L2 for SGD)")
    adam_beta1: float = opt(0.9, "AdamW beta1")
    adam_beta2: float = opt(0.999, "AdamW beta2 (Megatron-LM's default; GPT-3 recipes set 0.95)")
    adam_eps: float = opt(1e-8, "AdamW epsilon")
    clip_grad: float = opt(1.0, "clip the global gradient norm to this (0 disables)")
    use_distributed_optimizer: bool = opt(
        False, "ZeRO-1: shard fp32 main weights and Adam state over the data-parallel group")
    data_parallel_sharding_strategy: str = opt(
        "no_shard", "ZeRO stage over the data-parallel group: no_shard, optim (ZeRO-1, as "
        "--use-distributed-optimizer), optim_grads (ZeRO-2: + gradients) or optim_grads_params (ZeRO-3: + "
        "parameters, gathered per model chunk; docs/zero.md)",
        choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    num_distributed_optimizer_instances: int = opt(
        1, "hybrid sharding: shard within d/K data-parallel ranks, replicate over the K groups")
    reshard_after_forward: bool = opt(
        True, "ZeRO-3 (the paper's stage 3): free gathered parameters after their forward and gather them again "
        "for their backward: per transformer layer, the next one prefetched, without a pipeline; per run of a "
        "chunk's forwards with one. --no-reshard-after-forward keeps each chunk gathered from its first to its "
        "last use in the step (more memory, fewer all-gathers; docs/zero.md)", action=argparse.BooleanOptionalAction)
    optimizer_cpu_offload: bool = opt(False, "ZeRO-Offload: the optimizer's state and element-wise step on the host "
                                      "(pinned buffers; ptdp/optim/offload.py)")
    optimizer: str = opt("adam", optimizers.optimizer_help(), choices=list(optimizers.CHOICES))
    sgd_momentum: float = opt(0.9, "SGD momentum (--optimizer sgd)")
    muon_momentum: float = opt(0.95, "Muon momentum: M <- mu M + (1 - mu) G")
    muon_nesterov: bool = opt(False, "Muon: orthogonalise G + mu (M - G), not M", aliases=("--muon-use-nesterov",))
    muon_split_qkv: bool = opt(True, "Muon: QKV as one matrix (default: Q, K, V apart)", flag="--muon-no-split-qkv")
    muon_scale_mode: str = opt("spectral", "Muon's update scale: sqrt(max(m, n)), sqrt(max(1, m/n)) (torch's), sqrt(m/n)",
                               choices=["spectral", "shape_scaling", "unit_rms_norm"])
    muon_extra_scale_factor: float = opt(1.0, "multiplies the Muon update (0.2 with spectral matches AdamW's RMS)")
    muon_num_ns_steps: int = opt(5, "Newton-Schulz iterations")
    muon_coefficient_type: str = opt("quintic", "Newton-Schulz (a, b, c): quintic (5k steps), simple (torch's), "
                                     "polar_express (>= 8), aol (4k)", choices=["quintic", "simple", "polar_express", "aol"])
    muon_fp32_matmul_prec: str = opt("medium", "Newton-Schulz arithmetic: low all bf16 (torch's), medium fp32 norm + "
                                     "bf16 (Megatron's), high fp32", choices=["low", "medium", "high"])

    @property
    def sharding(self) -> str:
        """The effective ZeRO strategy (``effective_sharding``)."""
        return effective_sharding(self.data_parallel_sharding_strategy, self.use_distributed_optimizer)

    @property
    def kind(self) -> str:
        """The optimizer that runs, by its registered name: ``dist_muon`` is ``muon`` (ptdp's Muon always
        spreads the matrices; ``ptdp.config.optimizers``)."""
        return optimizers.canonical_name(self.optimizer)


def effective_sharding(strategy: str, use_distributed_optimizer: bool) -> str:
    """The ZeRO strategy that runs: ``--use-distributed-optimizer`` alone (strategy ``no_shard``) means ``optim``
    (``ptdp train``'s ``OptimizerConfig.sharding`` and the planner's ``ParallelConfig.strategy``)."""
    return "optim" if strategy == "no_shard" and use_distributed_optimizer else strategy


@dataclass
class TrainingConfig:
    micro_batch_size: int = opt(4, "micro-batch size b")
    global_batch_size: int = opt(32, "global batch size B = b x microbatches x d")
    train_iters: int = opt(100, "training iterations")
    seed: int = opt(1234, "random seed: initialisation, data order and dropout")
    log_interval: int = opt(10, "iterations between progress lines")
    metrics_file: str | None = opt(None, "append one JSON object per iteration to this file")
    grad_bucket_size_mb: float = opt(25.0, "data-parallel gradient all-reduce bucket size (MB)")
    eval_interval: int | None = opt(None, "compute the validation loss every N iterations and at the end")
    eval_iters: int = opt(10, "global batches of the validation split per evaluation")
    full_validation: bool = opt(False, "each evaluation reads the whole validation split once, in whole global "
                                "batches (instead of --eval-iters of them; Megatron-LM's flag)")
    skip_train: bool = opt(False, "no training: evaluate the validation and test splits with --load's checkpoint "
                           "(--eval-iters batches each, or the whole validation split with --full-validation) "
                           "and exit")
    overlap_grad_reduce: bool = opt(
        False, "reduce each gradient bucket asynchronously during the last microbatch's backward")
    tensorboard_dir: str | None = opt(None, "write loss, lr, grad norm, throughput, memory as TensorBoard "
                                      "scalars here (rank 0)")
    # Weights & Biases, Megatron-LM's flags (ptdp/observability/wandb_writer.py)
    wandb_project: str | None = opt(None, "log the --tensorboard-dir scalars to this Weights & Biases project "
                                    "(rank 0; offline, for `wandb sync`, unless WANDB_API_KEY is set)")
    wandb_exp_name: str | None = opt(None, "the W&B run's name, with --wandb-project (default: wandb's)")
    wandb_save_dir: str | None = opt(None, "the W&B run files' directory, with --wandb-project (default: --save "
                                     "DIR/wandb, else ./wandb)")
    timeline: str | None = opt(None, "write a Chrome trace per rank (DIR/rank{N}.json) and DIR/merged.json "
                               "of the first --timeline-iters iterations")
    timeline_iters: int = opt(3, "iterations the --timeline records")
    calculate_per_token_loss: bool = opt(
        False, "the loss is one mean over every unmasked token of the global batch (an all-reduce of the token "
        "counts) instead of each microbatch's mean averaged over microbatches and data-parallel ranks; differs "
        "only with --eod-mask-loss or --sft")


@dataclass
class MixedPrecisionConfig:
    """16-bit parameters and activations with fp32 main weights (Megatron's flags); see ``ptdp.optim``."""

    bf16: bool = opt(False, "bf16 parameters and activations, fp32 main weights and gradients")
    fp16: bool = opt(False, "fp16 parameters and activations with loss scaling, fp32 main weights (GPU only)")
    loss_scale: float | None = opt(None, "static fp16 loss scale (default: dynamic)")
    initial_loss_scale: float = opt(2.0**32, "initial dynamic fp16 loss scale")
    min_loss_scale: float = opt(1.0, "lower bound of the dynamic fp16 loss scale")
    loss_scale_window: int = opt(1000, "clean iterations before the dynamic loss scale doubles")
    hysteresis: int = opt(2, "overflows tolerated before the dynamic loss scale halves")
    accumulate_allreduce_grads_in_fp32: bool = opt(
        False, "accumulate and all-reduce fp16 gradients in fp32 (always on with --bf16)")
    fp8_format: str | None = opt(None, "FP8 GEMMs in the transformer layers through torchao (needs --bf16 and a "
                                 "GPU of compute capability >= 8.9): e4m3 everywhere, or hybrid (e5m2 gradients); "
                                 "embedding, output layer and router stay bf16", choices=["e4m3", "hybrid"])
    fp8_recipe: str = opt("tensorwise", "FP8 scaling: one dynamic scale per tensor, or per row",
                          choices=["tensorwise", "rowwise"])


@dataclass
class DataConfig:
    data_path: list[str] = opt([], "indexed dataset prefix(es), Megatron's [weight] prefix form; "
                               "default: the embedded standard-library corpus", nargs="*")
    split: str = opt("969,30,1", "train,valid,test proportions of --data-path's documents")
    # Megatron's per-split datasets: each split reads all of its own datasets (--data-path and --split unused)
    train_data_path: list[str] = opt([], "the training split's own dataset(s), all of each: a prefix, prefixes "
                                     "or a [weight] prefix blend, as --data-path", nargs="*")
    valid_data_path: list[str] = opt([], "the validation split's own dataset(s), as --train-data-path", nargs="*")
    test_data_path: list[str] = opt([], "the test split's own dataset(s), as --train-data-path", nargs="*")
    # Megatron's data and tokenizer flags (ptdp/data/tokenizer_flags.py, docs/data.md)
    data_cache_path: str | None = opt(None, "save/load the sample-order index arrays (.npy) in this directory")
    tokenizer_type: str | None = opt(None, "GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer, ByteTokenizer "
                                     "or PTDPBPETokenizer (default: the tokenizer saved beside the data)")
    tokenizer_model: str | None = opt(None, "Hugging Face tokenizer directory or tokenizer.json")
    vocab_file: str | None = opt(None, "GPT2BPETokenizer vocab.json")
    merge_file: str | None = opt(None, "GPT2BPETokenizer merges.txt")
    override_data_state: bool = opt(False, "with --load: start over every dataset whose files changed since the "
                                    "checkpoint (same prefix, other .idx/.bin) instead of refusing to resume")
    # Packed documents: Megatron's GPTDataset flags (ptdp/data/documents.py, docs/packing.md)
    reset_position_ids: bool = opt(False, "position ids restart at 0 after every end-of-document token")
    reset_attention_mask: bool = opt(False, "a token attends only to earlier tokens of its own document (the "
                                     "boundaries travel as cu_seqlens; only the blocks inside documents are computed)")
    eod_mask_loss: bool = opt(False, "leave out of the loss the positions whose input is the end-of-document "
                              "token (their target is the next document's first token)")
    # Chat fine-tuning (ptdp/data/sft_dataset.py, docs/sft.md)
    sft: bool = opt(False, "supervised fine-tuning on `ptdp preprocess --sft` data: whole conversations packed per "
                    "sample, attention and positions stop at each one, loss on assistant tokens only")
    sft_truncate: bool = opt(False, "with --sft: keep the first --seq-length + 1 tokens of a longer conversation "
                             "(default: refuse it)")


@dataclass
class CheckpointConfig:
    """Checkpoint flags (Megatron's names); the format and the checks live in ``ptdp.checkpointing``."""

    save: str | None = opt(None, "save checkpoints to DIR/iter_NNNNNNN (atomically) and point DIR/latest at them")
    save_interval: int | None = opt(None, "save every N iterations (a final checkpoint is always saved)")
    load: str | None = opt(None, "resume from DIR/latest, in any layout (a DIR without `latest` starts fresh)")
    exit_on_missing_checkpoint: bool = opt(False, "with --load: exit (code 2) instead of starting from scratch "
                                           "when DIR holds no checkpoint")
    exit_interval: int | None = opt(None, "stop cleanly after an iteration divisible by N (saving if --save)")
    keep_last: int | None = opt(None, "keep only the newest K checkpoints (pruned after a newer one is complete)")
    async_save: bool = opt(False, "write checkpoints in the background: the loop stalls only to copy the state")
    no_load_optim: bool = opt(False, "with --load: start the optimizer afresh (e.g. after changing --optimizer)")
    pretrained_checkpoint: str | None = opt(None, "start from this checkpoint's model weights (a base model for "
                                            "LoRA: the adapters start fresh; no optimizer, iteration 0); --load, when "
                                            "it holds a checkpoint, wins (a resumed fine-tuning run)")


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # Megatron-Bridge's module names


@dataclass
class LoRAConfig:
    """LoRA fine-tuning (Megatron-Bridge's knobs; ``ptdp.parallel.lora``, docs/lora.md): the base weights frozen,
    low-rank adapters trained beside the targeted linears. Off while ``--lora-rank`` is 0."""

    lora_rank: int = opt(0, "rank r of the LoRA adapters (0: no LoRA, every weight trains)")
    lora_alpha: float = opt(32.0, "LoRA alpha: an adapter adds (alpha/r) B A x to its linear's output")
    lora_dropout: float = opt(0.0, "dropout on the adapters' input")
    lora_target_modules: list[str] = opt(list(LORA_TARGETS), "the linears that get adapters (Megatron-Bridge's "
                                         "names): " + ", ".join(LORA_TARGETS), nargs="+")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def sections(self) -> dict[str, Any]:
        """The sections by name (``model``, ``parallel``, ...), as checkpoints record them."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def num_microbatches(self, world_size: int) -> int:
        par = self.parallel
        dp = world_size // (par.tensor_model_parallel_size * par.context_parallel_size * par.pipeline_model_parallel_size)
        return self.training.global_batch_size // (self.training.micro_batch_size * dp)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)
