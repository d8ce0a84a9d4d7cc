"""One validated configuration tree for a training run.

Every field carries its Megatron-LM flag name in its metadata; the ``ptdp train`` parser, the
``--config FILE.toml`` reader (same keys as the flags, dashes or underscores) and the validation all
come from these dataclasses, so a flag is declared exactly once. :func:`validate` checks the whole tree
against the world size before any process group exists and returns every problem as one line that names
the flag and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .pipeline.schedules import V_SCHEDULES


class ConfigError(Exception):
    """A problem with the user's configuration; the message is one line naming the flag."""


def opt(default: Any, help: str, flag: str | None = None, aliases: tuple[str, ...] = (), **argparse_kwargs: Any) -> Any:
    """A dataclass field with its command-line flag (derived from the field name unless given) and any
    older spellings of it (``aliases``: flags and TOML keys that Megatron-LM still accepts)."""
    metadata = {"help": help, "flag": flag, "aliases": aliases, "argparse": argparse_kwargs}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)



@dataclass
class ModelConfig:
    num_layers: int = opt(4, "number of transformer layers")
    hidden_size: int = opt(128, "hidden size h")
    num_attention_heads: int = opt(4, "attention heads a")
    ffn_hidden_size: int | None = opt(None, "MLP hidden size (default 4h)")
    seq_length: int = opt(128, "sequence length s")
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
    group_query_attention: bool = opt(False, "grouped-query attention: --num-query-groups K/V heads")
    num_query_groups: int = opt(1, "key/value head groups G with --group-query-attention (t must divide G)")
    untie_embeddings_and_output_weights: bool = opt(False, "a separate output layer instead of the input "
                                                    "embedding")
    disable_bias_linear: bool = opt(False, "no biases in the attention and MLP linears (Llama)")
    kv_channels: int | None = opt(None, "per-head dimension (default hidden size / heads)")
    vocab_size: int | None = opt(None, "vocabulary size (default: the tokenizer's)")
    recompute_granularity: str | None = opt(
        None, "activation recomputation: full (whole layers) or selective (attention core only)",
        choices=["full", "selective"])
    recompute_method: str | None = opt(
        None, "with full: uniform (units of --recompute-num-layers layers) or block (only the first "
        "--recompute-num-layers layers of each chunk); default uniform", choices=["uniform", "block"])
    recompute_num_layers: int | None = opt(None, "layers per recompute unit (uniform) or recomputed layers "
                                           "per chunk (block); default 1")
    compile: bool = opt(False, "torch.compile each transformer layer on a GPU (on the CPU: fused bias-GeLU and "
                        "bias-dropout-add); eager if it fails")

    @property
    def ffn_size(self) -> int:
        """Megatron's default: 4h, or with SwiGLU 2/3 of it rounded down to a multiple of 64 (same params)."""
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.swiglu else 4 * self.hidden_size

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


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = opt(1, "tensor-parallel size t (ranks adjacent, inside a node)")
    pipeline_model_parallel_size: int = opt(1, "pipeline-parallel size p")
    virtual_pipeline_model_parallel_size: int | None = opt(None, "model chunks per pipeline rank v")
    num_layers_per_virtual_pipeline_stage: int | None = opt(None, "Megatron's alternative way to set v")
    pipeline_schedule: str | None = opt(
        None, "pipeline schedule (default: interleaved when v > 1, else 1f1b). Bubble / activation memory "
        "against 1F1B's (p-1)/m / 1x: gpipe (p-1)/m / m microbatches; interleaved (p-1)/(v·m) / a bit more; "
        "zero-bubble (backward split into input and weight gradients): zb-h1 about a third of 1F1B's bubble "
        "/ 1x; zb-h2 less bubble when weight gradients are cheap / about 2x; zbv (two chunks per rank in a "
        "V, v=2) near zero / 1x; v-half about 1/2 the memory, bubble between zbv and 1F1B; v-min about 1/3 the "
        "memory, more bubble than 1F1B",
        choices=["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv", "v-half", "v-min"])
    scatter_gather_tensors_in_pipeline: bool = opt(
        True, "send 1/t of each boundary tensor and all-gather it in the TP group",
        flag="--no-scatter-gather-tensors-in-pipeline")
    distributed_timeout_minutes: float = opt(10.0, "process-group timeout, so a lost peer fails fast")
    hang_timeout_s: float = opt(300.0, "a rank without progress for this long is a hang: every rank's last "
                                "communication operations are written to the --save directory, the stopped "
                                "rank(s) named, and the job exits so the launcher restarts it (0 disables)")
    sequence_parallel: bool = opt(False, "split LayerNorm and dropout along the sequence across the TP group "
                                  "(needs t > 1)")
    context_parallel_size: int = opt(1, "context-parallel size c: each sample's sequence split over c ranks "
                                     "(2c load-balanced chunks; docs/context-parallel.md)")
    cp_comm_type: str = opt("p2p", "context-parallel attention: p2p (ring attention), a2a (Ulysses "
                            "all-to-all; local heads divisible by c) or allgather (all-gather K/V)",
                            choices=["p2p", "a2a", "allgather"])

    @property
    def virtual_size(self) -> int:
        """Model chunks per rank: the V schedules (zbv, v-half, v-min) always hold two."""
        return self.virtual_pipeline_model_parallel_size or (2 if self.pipeline_schedule in V_SCHEDULES else 1)

    @property
    def schedule(self) -> str:
        return self.pipeline_schedule or ("interleaved" if self.virtual_size > 1 else "1f1b")


@dataclass
class OptimizerConfig:
    lr: float = opt(6e-4, "peak learning rate")
    min_lr: float = opt(6e-5, "learning rate at the end of the decay")
    lr_warmup_iters: int = opt(10, "linear warm-up iterations")
    lr_decay_style: str = opt("cosine", "decay after warm-up", choices=["cosine", "linear", "constant"])
    lr_decay_iters: int | None = opt(None, "iterations to decay over (default: --train-iters)")
    weight_decay: float = opt(0.1, "AdamW weight decay (not on biases and LayerNorm)")
    adam_beta1: float = opt(0.9, "AdamW beta1")
    adam_beta2: float = opt(0.999, "AdamW beta2 (Megatron-LM's default; GPT-3 recipes set 0.95)")
    adam_eps: float = opt(1e-8, "AdamW epsilon")
    clip_grad: float = opt(1.0, "clip the global gradient norm to this (0 disables)")
    use_distributed_optimizer: bool = opt(
        False, "ZeRO-1: shard fp32 main weights and Adam state over the data-parallel group")


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
    overlap_grad_reduce: bool = opt(
        False, "reduce each gradient bucket asynchronously during the last microbatch's backward")
    tensorboard_dir: str | None = opt(None, "write loss, lr, grad norm, throughput, memory as TensorBoard "
                                      "scalars here (rank 0)")
    timeline: str | None = opt(None, "write a Chrome trace per rank (DIR/rank{N}.json) and DIR/merged.json "
                               "of the first --timeline-iters iterations")
    timeline_iters: int = opt(3, "iterations the --timeline records")


@dataclass
class MixedPrecisionConfig:
    """16-bit parameters and activations with fp32 main weights (Megatron's flags); see ``ptdp.optim``."""

    bf16: bool = opt(False, "bf16 parameters and activations, fp32 main weights and gradients")
    fp16: bool = opt(False, "fp16 parameters and activations with loss scaling, fp32 main weights")
    loss_scale: float | None = opt(None, "static fp16 loss scale (default: dynamic)")
    initial_loss_scale: float = opt(2.0**32, "initial dynamic fp16 loss scale")
    min_loss_scale: float = opt(1.0, "lower bound of the dynamic fp16 loss scale")
    loss_scale_window: int = opt(1000, "clean iterations before the dynamic loss scale doubles")
    hysteresis: int = opt(2, "overflows tolerated before the dynamic loss scale halves")
    accumulate_allreduce_grads_in_fp32: bool = opt(
        False, "accumulate and all-reduce fp16 gradients in fp32 (always on with --bf16)")


@dataclass
class DataConfig:
    data_path: list[str] = opt([], "indexed dataset prefix(es), Megatron's [weight] prefix form; "
                               "default: the embedded standard-library corpus", nargs="*")
    split: str = opt("969,30,1", "train,valid,test proportions")
    # Megatron's data and tokenizer flags (ptdp/data/tokenizer_flags.py, docs/data.md)
    data_cache_path: str | None = opt(None, "save/load the sample-order index arrays (.npy) in this directory")
    tokenizer_type: str | None = opt(None, "GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer, ByteTokenizer "
                                     "or PTDPBPETokenizer (default: the tokenizer saved beside the data)")
    tokenizer_model: str | None = opt(None, "Hugging Face tokenizer directory or tokenizer.json")
    vocab_file: str | None = opt(None, "GPT2BPETokenizer vocab.json")
    merge_file: str | None = opt(None, "GPT2BPETokenizer merges.txt")


@dataclass
class CheckpointConfig:
    """Checkpoint flags (Megatron's names); the format and the checks live in ``ptdp.checkpointing``."""

    save: str | None = opt(None, "save checkpoints to DIR/iter_NNNNNNN (atomically) and point DIR/latest at them")
    save_interval: int | None = opt(None, "save every N iterations (a final checkpoint is always saved)")
    load: str | None = opt(None, "resume from DIR/latest, in any layout (a DIR without `latest` starts fresh)")
    exit_interval: int | None = opt(None, "stop cleanly after an iteration divisible by N (saving if --save)")
    keep_last: int | None = opt(None, "keep only the newest K checkpoints (pruned after a newer one is complete)")
    async_save: bool = opt(False, "write checkpoints in the background: the loop stalls only to copy the state")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)

    @classmethod
    def section_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def sections(self) -> list[Any]:
        return [getattr(self, name) for name in self.section_names()]

    def num_microbatches(self, world_size: int) -> int:
        par = self.parallel
        dp = world_size // (par.tensor_model_parallel_size * par.context_parallel_size * par.pipeline_model_parallel_size)
        return self.training.global_batch_size // (self.training.micro_batch_size * dp)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per config field; defaults are None so that a TOML file can sit under the command line."""
    parser.add_argument("--config", help="TOML file with the same keys as the flags")
    from .presets import MODEL_PRESETS

    parser.add_argument("--model", choices=list(MODEL_PRESETS), help="a named model shape (ptdp/presets.py); "
                        "flags given explicitly override it")
    for name, section in zip(Config.section_names(), Config().sections(), strict=True):
        group = parser.add_argument_group(name)
        for f in dataclasses.fields(section):
            kwargs = dict(f.metadata["argparse"])
            help_text = f"{f.metadata['help']} (default: {_default(f)})"
            if f.type in ("bool", bool):
                action = "store_false" if _flag(f).startswith("--no-") else "store_true"
                group.add_argument(_flag(f), dest=f.name, action=action, default=None, help=help_text)
                continue
            kwargs.setdefault("type", _scalar_type(f))
            group.add_argument(_flag(f), *f.metadata["aliases"], dest=f.name, default=None, help=help_text,
                               **kwargs)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _scalar_type(f: dataclasses.Field):
    text = str(f.type)
    for name, typ in (("int", int), ("float", float), ("str", str)):
        if text.startswith(name) or f"[{name}]" in text:
            return typ
    return str


def config_from_args(args: argparse.Namespace) -> Config:
    """Defaults, then the TOML file, then the command line."""
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        path = Path(args.config)
        try:
            with path.open("rb") as fh:
                values = {k.replace("-", "_"): v for k, v in tomllib.load(fh).items()}
        except OSError as e:
            raise ConfigError(f"--config: cannot read {path}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--config: {path} is not valid TOML: {e}") from None
    config = Config()
    for f in dataclasses.fields(ModelConfig):  # older TOML spellings (layernorm-epsilon = norm-epsilon)
        for alias in f.metadata["aliases"]:
            if alias[2:].replace("-", "_") in values:
                values.setdefault(f.name, values.pop(alias[2:].replace("-", "_")))
    preset = getattr(args, "model", None) or values.pop("model", None)
    if preset is not None:  # --model NAME: under the TOML file and the flags
        from .presets import MODEL_PRESETS

        if preset not in MODEL_PRESETS:
            raise ConfigError(f"--model {preset!r} is not a preset; choose one of {', '.join(MODEL_PRESETS)}")
        for key, value in MODEL_PRESETS[preset].items():
            setattr(config.model, key, value)
    known: set[str] = set()
    for section in config.sections():
        for f in dataclasses.fields(section):
            known.add(f.name)
            if getattr(args, f.name, None) is not None:
                setattr(section, f.name, getattr(args, f.name))
            elif f.name in values:
                setattr(section, f.name, values[f.name])
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"--config: unknown key(s) {', '.join(unknown)} in {args.config}")
    return config


def validate(config: Config, world_size: int, local_world_size: int | None = None) -> list[str]:
    """Every problem with ``config`` for ``world_size`` processes (``local_world_size`` of them on each
    node, when known), one actionable line each."""
    m, par, tr, opt_ = config.model, config.parallel, config.training, config.optimizer
    t, p = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    errors: list[str] = []

    def positive(flag: str, value: Any) -> bool:
        if value is None or value <= 0:
            errors.append(f"{flag} must be a positive integer, got {value}")
            return False
        return True

    for flag, value in (("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size),
                        ("--num-attention-heads", m.num_attention_heads), ("--seq-length", m.seq_length),
                        ("--tensor-model-parallel-size", t), ("--pipeline-model-parallel-size", p),
                        ("--context-parallel-size", par.context_parallel_size),
                        ("--micro-batch-size", tr.micro_batch_size), ("--global-batch-size", tr.global_batch_size),
                        ("--train-iters", tr.train_iters), ("--log-interval", tr.log_interval),
                        ("--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by)):
        positive(flag, value)
    if errors:
        return errors
    for flag, value in (("--hidden-dropout", m.hidden_dropout), ("--attention-dropout", m.attention_dropout)):
        if not 0.0 <= value < 1.0:
            errors.append(f"{flag} must be in [0, 1), got {value}")
    c = par.context_parallel_size
    if world_size % (t * c * p):
        cp_text = " x --context-parallel-size" if c > 1 else ""
        sizes = f"{t}x{c}x{p}" if c > 1 else f"{t}x{p}"
        errors.append(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size{cp_text} x "
            f"--pipeline-model-parallel-size = {sizes}; use a world size that is a multiple of {t * c * p}")
        return errors
    d = world_size // (t * c * p)
    errors += _context_parallel_errors(config)
    if m.hidden_size % m.num_attention_heads:
        errors.append(f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads "
                      f"{m.num_attention_heads}")
    if m.num_attention_heads % t:
        errors.append(f"--num-attention-heads {m.num_attention_heads} is not divisible by "
                      f"--tensor-model-parallel-size {t}; choose t that divides the head count")
    if m.ffn_size % t:
        errors.append(f"--ffn-hidden-size {m.ffn_size} is not divisible by --tensor-model-parallel-size {t}")
    errors += _llama_errors(m, t)
    if m.vocab_size is not None and m.vocab_size <= 0:
        errors.append(f"--vocab-size must be positive, got {m.vocab_size}")
    if tr.global_batch_size % (tr.micro_batch_size * d):
        errors.append(
            f"--global-batch-size {tr.global_batch_size} is not a multiple of --micro-batch-size x "
            f"data-parallel size = {tr.micro_batch_size}x{d}; use a multiple of {tr.micro_batch_size * d}")
        return errors
    if par.num_layers_per_virtual_pipeline_stage is not None:
        per = par.num_layers_per_virtual_pipeline_stage
        if per <= 0 or m.num_layers % (per * p):
            errors.append(f"--num-layers-per-virtual-pipeline-stage {per} must divide --num-layers "
                          f"{m.num_layers} / --pipeline-model-parallel-size {p}")
        elif par.virtual_pipeline_model_parallel_size not in (None, m.num_layers // (per * p)):
            errors.append("give only one of --virtual-pipeline-model-parallel-size and "
                          "--num-layers-per-virtual-pipeline-stage")
        else:
            par.virtual_pipeline_model_parallel_size = m.num_layers // (per * p)
    v = par.virtual_size
    if v < 1:
        errors.append(f"--virtual-pipeline-model-parallel-size must be positive, got {v}")
        return errors
    if m.num_layers % (p * v):
        errors.append(f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size x "
                      f"virtual size = {p}x{v}; choose sizes so every model chunk gets the same layers")
    microbatches = tr.global_batch_size // (tr.micro_batch_size * d)
    if v > 1 and p == 1 and par.schedule not in V_SCHEDULES:
        errors.append("--virtual-pipeline-model-parallel-size needs --pipeline-model-parallel-size > 1; "
                      "model chunks interleave across pipeline ranks")
    if par.schedule in V_SCHEDULES and v != 2:
        errors.append(f"--pipeline-schedule {par.schedule} places two model chunks per rank in a V: "
                      f"leave out --virtual-pipeline-model-parallel-size or set it to 2 (got {v})")
    if par.schedule in V_SCHEDULES and p == 1:
        errors.append(f"--pipeline-schedule {par.schedule} needs --pipeline-model-parallel-size > 1")
    if par.schedule in ("gpipe", "1f1b", "zb-h1", "zb-h2") and v > 1:
        errors.append(f"--pipeline-schedule {par.schedule} needs v = 1; use --pipeline-schedule interleaved "
                      "with --virtual-pipeline-model-parallel-size")
    if par.schedule == "interleaved" and microbatches % p:
        errors.append(
            f"--pipeline-schedule interleaved needs the number of microbatches ({microbatches} = "
            f"--global-batch-size / (--micro-batch-size x d)) to be a multiple of "
            f"--pipeline-model-parallel-size {p}")
    if par.sequence_parallel and t == 1:  # as Megatron-LM: a warning and off, so configs move between layouts
        if int(os.environ.get("RANK", "0")) == 0:
            print("warning: --sequence-parallel is off because --tensor-model-parallel-size is 1", file=sys.stderr)
        par.sequence_parallel = False
    elif par.sequence_parallel and m.seq_length % t:
        errors.append(f"--seq-length {m.seq_length} is not divisible by --tensor-model-parallel-size {t}, "
                      "which --sequence-parallel needs; choose a multiple of t")
    from .recompute import recompute_errors

    errors += recompute_errors(m.recompute_granularity, m.recompute_method, m.recompute_num_layers,
                               m.num_layers // (p * v))
    if opt_.lr < 0 or opt_.min_lr < 0 or opt_.min_lr > opt_.lr:
        errors.append(f"--min-lr {opt_.min_lr} must be between 0 and --lr {opt_.lr}")
    if opt_.lr_warmup_iters < 0:
        errors.append(f"--lr-warmup-iters must be >= 0, got {opt_.lr_warmup_iters}")
    if opt_.lr_decay_iters is not None and opt_.lr_decay_iters <= 0:
        errors.append(f"--lr-decay-iters must be a positive integer, got {opt_.lr_decay_iters}")
    elif opt_.lr_decay_iters is not None and opt_.lr_warmup_iters > opt_.lr_decay_iters:
        errors.append(f"--lr-warmup-iters {opt_.lr_warmup_iters} is larger than --lr-decay-iters "
                      f"{opt_.lr_decay_iters}; the decay would start before the warm-up ends (Megatron refuses "
                      "it too): lower --lr-warmup-iters or raise --lr-decay-iters")
    if par.hang_timeout_s < 0:
        errors.append(f"--hang-timeout-s must be >= 0 (0 disables the watchdog), got {par.hang_timeout_s}")
    if opt_.clip_grad < 0:
        errors.append(f"--clip-grad must be >= 0, got {opt_.clip_grad}")
    errors += _precision_errors(config.precision)
    if tr.eval_interval is not None and tr.eval_interval <= 0 or tr.eval_iters <= 0:
        errors.append(f"--eval-interval {tr.eval_interval} and --eval-iters {tr.eval_iters} must be positive")
    if local_world_size and local_world_size % t:  # TP groups are adjacent ranks: keep them on NVLink
        errors.append(f"--tensor-model-parallel-size {t} does not divide the {local_world_size} processes "
                      "per node (--nproc-per-node / LOCAL_WORLD_SIZE); tensor parallelism must stay inside "
                      f"a node: choose t dividing {local_world_size}")
    from .observability import observability_errors

    errors += observability_errors(tr.tensorboard_dir, tr.timeline, tr.timeline_iters)
    # The checkpoint flags are checked by ptdp.checkpointing.validation.checkpoint_errors, which the
    # caller runs after this (``ptdp train`` does): importing it here would make config and
    # checkpointing import each other.
    return errors


def _context_parallel_errors(config: Config) -> list[str]:
    """``--context-parallel-size`` and ``--cp-comm-type``: the 2c load-balanced chunks must be equal
    (ptdp-facts.md, §context parallelism), Ulysses needs whole heads per CP rank, and the CP attention
    kernels take no attention dropout (one mask over s/c tokens cannot reproduce the full mask)."""
    m, par = config.model, config.parallel
    c, t = par.context_parallel_size, par.tensor_model_parallel_size
    if c == 1:
        return []
    errors = []
    if m.seq_length % (2 * c):
        errors.append(f"--context-parallel-size {c} needs --seq-length divisible by 2c = {2 * c} (the "
                      f"sequence is cut into 2c equal chunks), got {m.seq_length}")
    elif par.sequence_parallel and (m.seq_length // c) % t:
        errors.append(f"--sequence-parallel with --context-parallel-size {c} needs --seq-length / c = "
                      f"{m.seq_length // c} divisible by --tensor-model-parallel-size {t}")
    if par.cp_comm_type == "a2a" and (m.num_attention_heads // t) % c:
        errors.append(f"--cp-comm-type a2a needs the local heads --num-attention-heads / t = "
                      f"{m.num_attention_heads // t} divisible by --context-parallel-size {c}; use p2p or "
                      "allgather, or another c")
    if m.attention_dropout > 0:
        errors.append(f"--context-parallel-size {c} needs --attention-dropout 0 (the context-parallel "
                      f"attention kernels take no dropout), got {m.attention_dropout}")
    return errors


def _llama_errors(m: ModelConfig, t: int) -> list[str]:
    """The Llama-family flags: head shapes RoPE and grouped-query attention can split over t ranks."""
    errors = []
    if m.kv_channels is not None and m.kv_channels <= 0:
        errors.append(f"--kv-channels must be a positive integer, got {m.kv_channels}")
        return errors
    if not m.norm_epsilon > 0:
        errors.append(f"--norm-epsilon must be > 0, got {m.norm_epsilon}")
    if m.group_query_attention:
        g, a = m.num_query_groups, m.num_attention_heads
        if g <= 0 or a % g:
            errors.append(f"--num-query-groups {g} must be positive and divide --num-attention-heads {a}")
        elif g % t:
            errors.append(f"--num-query-groups {g} is not divisible by --tensor-model-parallel-size {t}; each "
                          "tensor-parallel rank needs whole key/value groups: choose t dividing G")
    if m.position_embedding_type == "rope":
        rotary = int(m.head_dim * m.rotary_percent)
        if not 0.0 < m.rotary_percent <= 1.0 or rotary < 2 or rotary % 2:
            errors.append(f"--rotary-percent {m.rotary_percent} of the head dimension {m.head_dim} must rotate "
                          "a positive even number of dimensions (0 < percent <= 1)")
        if not m.rotary_base > 0:
            errors.append(f"--rotary-base must be > 0, got {m.rotary_base}")
    if m.use_rope_scaling and (m.position_embedding_type != "rope" or not m.rope_scaling_factor > 0):
        errors.append("--use-rope-scaling needs --position-embedding-type rope and --rope-scaling-factor > 0")
    return errors


def _precision_errors(mp: MixedPrecisionConfig) -> list[str]:
    errors = []
    if mp.bf16 and mp.fp16:
        errors.append("--bf16 and --fp16 are exclusive; give one of them")
    if mp.loss_scale is not None and (not mp.fp16 or mp.loss_scale <= 0):
        errors.append(f"--loss-scale {mp.loss_scale} needs --fp16 and a positive value")
    if mp.initial_loss_scale <= 0 or mp.min_loss_scale <= 0 or mp.min_loss_scale > mp.initial_loss_scale:
        errors.append(f"--min-loss-scale {mp.min_loss_scale} must be positive and at most --initial-loss-scale "
                      f"{mp.initial_loss_scale}")
    if mp.loss_scale_window < 1 or mp.hysteresis < 1:
        errors.append(f"--loss-scale-window {mp.loss_scale_window} and --hysteresis {mp.hysteresis} must be >= 1")
    return errors
