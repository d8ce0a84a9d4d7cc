"""Every problem with a configuration for a world size, one line each naming the flag and the fix.

:func:`validate` is a pure function: it reads the configuration and never changes it (derived values,
such as v from ``--num-layers-per-virtual-pipeline-stage``, come from ``ptdp.config.derive``, which
returns a new object). It checks the whole tree before any process group exists and does not stop at the
first problem: a check that needs a value another check rejected (the data-parallel size needs a world
size that t·c·p divides) is skipped, so each line is a real, independent problem. The pipeline flags (v,
the schedule, the layout, the vocabulary) are checked by ``validate_pipeline``, the experts' by
``validate_moe``. Nothing here touches the file system or asks what this machine has: directories, packages
and GPUs are start-up checks (``ptdp.cli.main.start_problems``).
"""

from __future__ import annotations

from typing import Any

from ptdp.config.features import fp8_errors, recompute_errors, saved_activation_errors
from ptdp.config.load import type_problems
from ptdp.config.schema import Config, ConfigError, MixedPrecisionConfig, ModelConfig
from ptdp.config.validate_linear import linear_errors
from ptdp.config.validate_moe import deepseek_errors, expert_layout_errors, moe_errors
from ptdp.config.validate_pipeline import (
    overlap_errors,
    schedule_problems,
    stages_of,
    virtual_size,
    vocab_parallel_errors,
)
from ptdp.config.validate_window import window_errors
from ptdp.schedule.layout import Stage


def pipeline_layout(config: Config, p: int, v: int) -> tuple[list[Stage], list[str]]:
    """The p·v stages (``ptdp.schedule.layout``) and, if the layout flags do not add up, the one problem line."""
    try:
        return stages_of(config, p, v), []
    except ConfigError as e:
        return [], e.problems


def validate(config: Config, world_size: int, local_world_size: int | None = None) -> list[str]:
    """Every problem with ``config`` for ``world_size`` processes (``local_world_size`` of them on each
    node, when known), one actionable line each; ``config`` is not modified."""
    problems = type_problems(config)
    if problems:  # the checks below compare numbers: a string where an integer belongs stops them
        return problems
    m, par, tr = config.model, config.parallel, config.training
    t, p, c = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size
    errors: list[str] = []
    bad: set[str] = set()
    for flag, value in (("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size),
                        ("--num-attention-heads", m.num_attention_heads), ("--seq-length", m.seq_length),
                        ("--tensor-model-parallel-size", t), ("--pipeline-model-parallel-size", p),
                        ("--context-parallel-size", c),
                        ("--micro-batch-size", tr.micro_batch_size), ("--global-batch-size", tr.global_batch_size),
                        ("--train-iters", tr.train_iters), ("--log-interval", tr.log_interval),
                        ("--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by)):
        if value <= 0:
            errors.append(f"{flag} must be a positive integer, got {value}")
            bad.add(flag)
    if m.max_position_embeddings is not None and m.seq_length > m.max_position_embeddings > 0:
        errors.append(f"--seq-length {m.seq_length} is longer than --max-position-embeddings "
                      f"{m.max_position_embeddings}, the longest sequence the model is built for")
    for flag, value in (("--hidden-dropout", m.hidden_dropout), ("--attention-dropout", m.attention_dropout)):
        if not 0.0 <= value < 1.0:
            errors.append(f"{flag} must be in [0, 1), got {value}")
    sizes_ok = not bad & {"--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size"}
    shape_ok = not bad & {"--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length"}
    d = None
    if sizes_ok and world_size % (t * c * p):
        cp_text = " x --context-parallel-size" if c > 1 else ""
        sizes = f"{t}x{c}x{p}" if c > 1 else f"{t}x{p}"
        errors.append(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size{cp_text} x "
            f"--pipeline-model-parallel-size = {sizes}; use a world size that is a multiple of {t * c * p}")
    elif sizes_ok:
        d = world_size // (t * c * p)
    if sizes_ok and shape_ok:
        errors += _shape_errors(config)
    microbatches = None
    if d is not None and not bad & {"--micro-batch-size", "--global-batch-size"}:
        replicas = max(par.fault_tolerant_replicas, 1)  # world_size is one replica group's
        shares = f" x --fault-tolerant-replicas {replicas}" if replicas > 1 else ""
        if tr.global_batch_size % (tr.micro_batch_size * d * replicas):
            errors.append(
                f"--global-batch-size {tr.global_batch_size} is not a multiple of --micro-batch-size x "
                f"data-parallel size{shares} = {tr.micro_batch_size}x{d}{f'x{replicas}' if shares else ''}; "
                f"use a multiple of {tr.micro_batch_size * d * replicas}")
        else:
            microbatches = tr.global_batch_size // (tr.micro_batch_size * d * replicas)
    v, v_errors = virtual_size(config) if sizes_ok and shape_ok else (None, [])
    errors += v_errors
    if v is not None and v < 1:
        errors.append(f"--virtual-pipeline-model-parallel-size must be positive, got {v}")
    elif v is not None:
        stages, layout_errors = pipeline_layout(config, p, v)  # even, or Megatron's uneven layout flags
        errors += layout_errors
        errors += schedule_problems(par.pipeline_schedule, p, v, microbatches)
        errors += recompute_errors(m.recompute_granularity, m.recompute_method, m.recompute_num_layers,
                                   max((len(s.layers) for s in stages), default=m.num_layers // (p * v)))
    errors += saved_activation_errors(config)
    errors += _optimizer_errors(config)
    if d is not None:
        errors += _sharding_errors(config, d)
    if par.hang_timeout_s < 0:
        errors.append(f"--hang-timeout-s must be >= 0 (0 disables the watchdog), got {par.hang_timeout_s}")
    errors += _precision_errors(config.precision)
    errors += moe_errors(config)
    errors += window_errors(config)  # sliding windows (Gemma 3)
    errors += linear_errors(config)  # Gated DeltaNet layers (Qwen3-Next)
    errors += deepseek_errors(config) if sizes_ok and shape_ok else []
    if sizes_ok and not bad & {"--micro-batch-size"}:  # expert parallelism and MoE Parallel Folding
        errors += expert_layout_errors(
            world_size=world_size, t=t, c=c, p=p, e=par.expert_model_parallel_size,
            etp=par.expert_tensor_parallel_size, num_experts=config.moe.num_experts,
            sequence_parallel=par.sequence_parallel, tokens_per_rank=tr.micro_batch_size * m.seq_length // c)
    errors += fp8_errors(config)
    if tr.eval_interval is not None and tr.eval_interval <= 0:
        errors.append(f"--eval-interval must be positive, got {tr.eval_interval}")
    if tr.eval_iters < 0:  # 0, as in Megatron-LM: no validation and no test evaluation
        errors.append(f"--eval-iters must be >= 0 (0 turns evaluation off), got {tr.eval_iters}")
    if d is not None and local_world_size and local_world_size % t:  # TP groups: adjacent ranks, on NVLink
        errors.append(f"--tensor-model-parallel-size {t} does not divide the {local_world_size} processes "
                      "per node (--nproc-per-node / LOCAL_WORLD_SIZE); tensor parallelism must stay inside "
                      f"a node: choose t dividing {local_world_size}")
    if tr.timeline_iters is not None and tr.timeline_iters <= 0:
        errors.append(f"--timeline-iters must be a positive integer, got {tr.timeline_iters}")
    errors += vocab_parallel_errors(config) if sizes_ok else []
    errors += overlap_errors(config)
    from ptdp.config.validate_data import data_errors  # per-split datasets, --skip-train

    errors += data_errors(config)
    from ptdp.config.validate_lora import lora_errors  # LoRA fine-tuning (docs/lora.md)

    errors += lora_errors(config)
    from ptdp.config.validate_replicas import replica_errors  # fault-tolerant replica groups

    errors += replica_errors(config)
    # The checkpoint flags are checked by ptdp.checkpointing.validation.checkpoint_errors, which the
    # caller runs after this (``ptdp train`` does): importing it here would make config and
    # checkpointing import each other.
    return errors


def _shape_errors(config: Config) -> list[str]:
    """The model shape against the tensor, sequence and context parallel sizes (all positive here)."""
    m, par = config.model, config.parallel
    t = par.tensor_model_parallel_size
    errors = _context_parallel_errors(config)
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
    if par.sequence_parallel and t > 1 and m.seq_length % t:  # t = 1: derive turns it off, as Megatron-LM
        errors.append(f"--seq-length {m.seq_length} is not divisible by --tensor-model-parallel-size {t}, "
                      "which --sequence-parallel needs; choose a multiple of t")
    return errors


def _optimizer_errors(config: Config) -> list[str]:
    opt_, errors = config.optimizer, []
    if opt_.lr < 0:
        errors.append(f"--lr must be >= 0, got {opt_.lr}")
    elif opt_.min_lr < 0 or opt_.min_lr > opt_.lr:
        errors.append(f"--min-lr {opt_.min_lr} must be between 0 and --lr {opt_.lr}")
    if opt_.lr_warmup_iters < 0:
        errors.append(f"--lr-warmup-iters must be >= 0, got {opt_.lr_warmup_iters}")
    if opt_.lr_decay_iters is not None and opt_.lr_decay_iters <= 0:
        errors.append(f"--lr-decay-iters must be a positive integer, got {opt_.lr_decay_iters}")
    elif opt_.lr_decay_iters is not None and opt_.lr_warmup_iters > opt_.lr_decay_iters:
        errors.append(f"--lr-warmup-iters {opt_.lr_warmup_iters} is larger than --lr-decay-iters "
                      f"{opt_.lr_decay_iters}; the decay would start before the warm-up ends (Megatron refuses "
                      "it too): lower --lr-warmup-iters or raise --lr-decay-iters")
    if opt_.clip_grad < 0:
        errors.append(f"--clip-grad must be >= 0, got {opt_.clip_grad}")
    return errors + _momentum_errors(opt_)


# Newton-Schulz coefficient sets (ptdp.optim.newton_schulz.COEFFICIENTS): how many triples each has, and
# whether the steps must be a multiple of that ("cycle") or at least that many ("at least").
NS_COEFFICIENTS = {"simple": (1, "cycle"), "quintic": (5, "cycle"), "polar_express": (8, "at least"),
                   "aol": (4, "cycle")}


def _momentum_errors(opt_) -> list[str]:
    """``--sgd-momentum``, ``--muon-momentum`` in [0, 1) and a Newton-Schulz step count the coefficient set
    can run (emerging_optimizers' rules)."""
    errors = []
    for flag, value in (("--sgd-momentum", opt_.sgd_momentum), ("--muon-momentum", opt_.muon_momentum)):
        if not 0 <= value < 1:
            errors.append(f"{flag} must be in [0, 1), got {value}")
    steps, kind = opt_.muon_num_ns_steps, opt_.muon_coefficient_type
    count, rule = NS_COEFFICIENTS[kind]
    if steps < 1:
        errors.append(f"--muon-num-ns-steps must be a positive integer, got {steps}")
    elif (rule == "cycle" and steps % count) or (rule == "at least" and steps < count):
        need = f"a multiple of {count}" if rule == "cycle" else f"at least {count}"
        errors.append(f"--muon-num-ns-steps {steps} does not fit --muon-coefficient-type {kind}, whose "
                      f"{count} coefficient triple(s) need {need} steps; change either")
    return errors


def _sharding_errors(config: Config, d: int) -> list[str]:
    """ZeRO needs data-parallel peers to shard over (the dp-cp group: d x c ranks), and hybrid sharding's
    K instances must split d evenly -- and, with experts, their expert-data-parallel groups."""
    opt_, c = config.optimizer, config.parallel.context_parallel_size
    errors, k = [], opt_.num_distributed_optimizer_instances
    if opt_.data_parallel_sharding_strategy != "no_shard" and d * c == 1:
        errors.append(f"--data-parallel-sharding-strategy {opt_.data_parallel_sharding_strategy} needs a "
                      "data-parallel size d > 1 (d = 1 here); use no_shard or more processes")
    if k < 1 or d % k:
        errors.append(f"--num-distributed-optimizer-instances {k} must divide the data-parallel size d = {d}")
    elif k > 1 and opt_.sharding == "no_shard":
        errors.append(f"--num-distributed-optimizer-instances {k} needs a --data-parallel-sharding-strategy "
                      "other than no_shard")
    par = config.parallel
    t, e, etp = par.tensor_model_parallel_size, par.expert_model_parallel_size, par.expert_tensor_parallel_size
    stage = t * c * d  # the ranks of one pipeline stage; the experts shard over edp of them (expert_dims.py)
    edp = stage // ((etp or t) * e) if e >= 1 and stage % ((etp or t) * e) == 0 else None
    if config.moe.num_experts and k > 1 and not d % k and edp is not None and edp % k:
        errors.append(f"--num-distributed-optimizer-instances {k} must divide the expert-data-parallel size "
                      f"{edp} (t·c·d / (etp·e)) too: the expert weights are sharded over K instances as well")
    return errors


def _context_parallel_errors(config: Config) -> list[str]:
    """``--context-parallel-size`` and ``--cp-comm-type``: the 2c load-balanced chunks must be equal
    (docs/references.md, §Context parallelism), Ulysses needs whole heads per CP rank, and the CP attention
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
    errors: list[Any] = []
    if m.kv_channels is not None and m.kv_channels <= 0:
        errors.append(f"--kv-channels must be a positive integer, got {m.kv_channels}")
    if not m.norm_epsilon > 0:
        errors.append(f"--norm-epsilon must be > 0, got {m.norm_epsilon}")
    if m.group_query_attention:
        g, a = m.num_query_groups, m.num_attention_heads
        if g <= 0 or a % g:
            errors.append(f"--num-query-groups {g} must be positive and divide --num-attention-heads {a}")
        elif g % t:
            errors.append(f"--num-query-groups {g} is not divisible by --tensor-model-parallel-size {t}; each "
                          "tensor-parallel rank needs whole key/value groups: choose t dividing G")
    if m.position_embedding_type == "rope" and not (m.kv_channels is not None and m.kv_channels <= 0):
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
