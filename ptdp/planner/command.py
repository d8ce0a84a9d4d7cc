"""``ptdp plan``: evaluate one PTD-P layout, or search for the fastest that fits. Wired into ptdp/cli/main.py."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from ptdp import config as train_config
from ptdp.config import ConfigError, ModelConfig, MoEConfig, add_field_arguments, model_config
from ptdp.config.optimizers import canonical_name, optimizer_spec
from ptdp.config.validate_moe import moe_errors
from ptdp.config.validate_pipeline import layout_stage_count
from ptdp.models.flops import moe_shape, windowed_attention_length
from ptdp.planner.experts import DEFAULT_DISPATCHER, expert_column, expert_lines, expert_split_words
from ptdp.planner.search import Estimate, Space, evaluate, invalid_reason, search
from ptdp.planner.spec import (
    MODEL_PRESETS,
    RECOMPUTE_CHOICES,
    ClusterSpec,
    GPTSpec,
    ParallelConfig,
    TrainingSpec,
)
from ptdp.planner.vocab import vocab_column, vocab_lines
from ptdp.runtime.hardware import ACCELERATORS, GIB
from ptdp.schedule.registry import default_virtual_size, pair_share, schedule_spec

_MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")
_ARCH_FLAGS = ("ffn_hidden_size", "kv_channels", "num_query_groups", "swiglu", "untie_embeddings_and_output_weights",
               "disable_bias_linear", "disable_bias_norm", "normalization", "position_embedding_type",
               # multi-latent attention and multi-token prediction
               "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
               "v_head_dim", "mtp_num_layers")
# A mixture of experts' shape, as ``ptdp train`` spells it (the routing and loss flags change no count)
_MOE_FLAGS = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
              "moe_shared_expert_intermediate_size", "moe_shared_expert_gate")


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``ptdp plan`` (Megatron names). Giving both t and p evaluates that layout; else search."""
    m = parser.add_argument_group("model (or --model PRESET): ptdp train's flags")
    m.add_argument("--model", choices=sorted(MODEL_PRESETS), help="preset shape; explicit flags override it")
    add_field_arguments(m, ModelConfig, (*_MODEL_FLAGS, *_ARCH_FLAGS, "group_query_attention"))
    add_field_arguments(m, train_config.TrainingConfig, ("global_batch_size",))
    add_field_arguments(m, MoEConfig, _MOE_FLAGS)  # a MoE preset's experts, or a dense shape's
    add_field_arguments(m, train_config.DataConfig, ("reset_attention_mask",))  # packed documents
    m.add_argument("--mean-document-length", type=int, metavar="L",
                   help="with --reset-attention-mask: documents of L tokens fill each window, so attention "
                   "counts sum(l^2)/s = L keys per query instead of s (FLOPs, time, score memory)")
    c = parser.add_argument_group("cluster")
    c.add_argument("--gpus", type=int, help="total number of GPUs n = t*p*d")
    c.add_argument("--gpu", choices=sorted(ACCELERATORS), default="a100-80gb")
    c.add_argument("--gpus-per-node", type=int, help="default: the GPU's server (8)")
    c.add_argument("--intra-node-bandwidth", type=float, help="GB/s per GPU per direction (NVLink); default per GPU")
    c.add_argument("--inter-node-bandwidth", type=float, help="GB/s per GPU per direction (network); default per GPU")
    t = parser.add_argument_group("training (ptdp train's flags)")
    add_field_arguments(t, train_config.MixedPrecisionConfig, ("bf16", "fp16"), overrides={
        "bf16": {"help": "bf16 parameters, fp32 main gradients: 18 B/param"},
        "fp16": {"help": "fp16 parameters and gradients, as in the paper: 20 B/param (the default)"}})
    add_field_arguments(t, train_config.TrainingConfig, ("overlap_grad_reduce",), overlap_grad_reduce=False)
    p = parser.add_argument_group("layout (ptdp train's flags; each given flag pins that dimension of the search)")
    add_field_arguments(p, train_config.ParallelConfig, (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
        "context_parallel_size", "sequence_parallel", "cp_comm_type", "pipeline_schedule"),
        cp_comm_type="p2p", sequence_parallel=False)
    # evaluate a given vocabulary handling (with t and p); the search tries both by itself
    add_field_arguments(p, train_config.ParallelConfig, (
        "pipeline_model_parallel_layout", "enable_vocab_parallel", "disable_fb_fusion"),
        enable_vocab_parallel=False, disable_fb_fusion=False)
    add_field_arguments(p, train_config.TrainingConfig, ("micro_batch_size",))
    # a mixture of experts' expert layout (default: search e, etp and the dispatcher)
    add_field_arguments(p, train_config.ParallelConfig, ("expert_model_parallel_size", "expert_tensor_parallel_size"))
    add_field_arguments(p, train_config.MoEConfig, ("moe_token_dispatcher_type",))
    # pin the combined 1F1B overlap (default: search it, and dualpipev, for a MoE layout at e > 1)
    add_field_arguments(p, train_config.ParallelConfig, ("overlap_moe_expert_parallel_comm",),
                        overlap_moe_expert_parallel_comm=None)
    # The search space has two values train spells by leaving a flag out: no recomputation (``none``), and
    # the distributed optimizer pinned off (``--no-use-distributed-optimizer``).
    add_field_arguments(p, ModelConfig, ("recompute_granularity",), overrides={"recompute_granularity": {
        "choices": RECOMPUTE_CHOICES, "help": "pin the recomputation: none, selective or full (default: search all)"}})
    add_field_arguments(p, train_config.OptimizerConfig, ("use_distributed_optimizer",), overrides={
        "use_distributed_optimizer": {"action": argparse.BooleanOptionalAction,
                                      "help": "pin ZeRO-1 on, or off with --no-use-distributed-optimizer "
                                      "(default: search both)"}})
    add_field_arguments(p, train_config.OptimizerConfig, ("optimizer",), optimizer="adam")
    add_field_arguments(p, train_config.OptimizerConfig, (
        "data_parallel_sharding_strategy", "num_distributed_optimizer_instances"), overrides={
        "data_parallel_sharding_strategy": {"help": "pin the ZeRO stage (default: search all four)"},
        "num_distributed_optimizer_instances": {
            "help": "pin hybrid sharding K (shard over d/K ranks, replicate over K; default 1)"}})
    o = parser.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object")
    o.add_argument("--top", type=int, default=5, metavar="K", help="runners-up to show (default 5)")


class _UsageError(Exception):
    pass


def _positive(args: argparse.Namespace, name: str) -> None:
    value = vars(args)[name]  # the flags by field name, as add_field_arguments declared them
    if value is not None and value < 1:
        raise _UsageError(f"--{name.replace('_', '-')} must be a positive number, got {value}")


def _model(args: argparse.Namespace) -> GPTSpec:
    """The planned model: ``ptdp train``'s ``ModelConfig`` and ``MoEConfig`` (preset, then the flags given)
    as the planner's frozen shape."""
    from ptdp.config.presets import MODEL_PRESETS as ALL_PRESETS

    preset = ALL_PRESETS[args.model] if args.model else {}
    given = vars(args)  # the flags by field name, as add_field_arguments declared them
    values = {k: given[k] for k in (*_MODEL_FLAGS, *_ARCH_FLAGS, "group_query_attention")}
    for k in _MODEL_FLAGS:
        if values[k] is None and k not in preset:
            raise _UsageError(f"--{k.replace('_', '-')} is required (or pass --model gpt3-175b)")
    if values["num_query_groups"] is not None:  # the planner's shorthand: G given means grouped-query
        values["group_query_attention"] = True
    cfg = model_config(values, args.model)
    if cfg.hidden_size % cfg.num_attention_heads:
        raise _UsageError("--hidden-size must be divisible by --num-attention-heads")
    if args.group_query_attention and args.num_query_groups is None and not preset.get("group_query_attention"):
        raise _UsageError("--group-query-attention needs --num-query-groups G")
    groups = cfg.num_query_groups if cfg.group_query_attention else None
    if groups is not None and (groups < 1 or cfg.num_attention_heads % groups):
        raise _UsageError(f"--num-query-groups {groups} must divide --num-attention-heads {cfg.num_attention_heads}")
    moe = _experts(args, cfg)
    spec = GPTSpec.from_model_config(cfg)  # its attention_length: the sliding windows' (None: none)
    documents = _attention_length(args, cfg.seq_length)
    return dataclasses.replace(spec, moe=moe_shape(cfg, moe), attention_length=(
        spec.attention_length if documents is None else windowed_attention_length(cfg, documents) or documents))


def _attention_length(args: argparse.Namespace, seq_length: int) -> float | None:
    """``GPTSpec.attention_length`` of ``--reset-attention-mask --mean-document-length L``: min(L, s)."""
    length = vars(args)["mean_document_length"]
    if not vars(args)["reset_attention_mask"]:
        if length is not None:
            raise _UsageError("--mean-document-length needs --reset-attention-mask (without it attention spans "
                              "the whole window)")
        return None
    if length is None or length < 1:
        raise _UsageError("--reset-attention-mask needs --mean-document-length L (a positive number of tokens): "
                          "the attention computed depends on the documents' lengths")
    return float(min(length, seq_length))


def _experts(args: argparse.Namespace, model: ModelConfig) -> MoEConfig:
    """``ptdp train``'s ``MoEConfig``: the preset's experts, then the flags given, checked by train's rules
    (``validate_moe``); every problem one line."""
    from ptdp.config.presets import MOE_PRESETS

    given = vars(args)  # the flags by field name, as add_field_arguments declared them
    moe = dataclasses.replace(MoEConfig(**MOE_PRESETS.get(args.model, {})),
                              **{k: given[k] for k in _MOE_FLAGS if given[k] is not None})
    errors = moe_errors(train_config.Config(model=model, moe=moe))
    if errors:
        raise _UsageError("\n".join(errors))
    return moe


def _setup(args: argparse.Namespace) -> tuple[GPTSpec, ClusterSpec, TrainingSpec]:
    for name in (*_MODEL_FLAGS, "ffn_hidden_size", "kv_channels", "global_batch_size", "gpus", "gpus_per_node",
                 "intra_node_bandwidth", "inter_node_bandwidth", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size", "micro_batch_size", "top"):
        _positive(args, name)
    model = _model(args)
    if args.global_batch_size is None:
        from ptdp.config.presets import PLAN_GLOBAL_BATCH

        if args.model not in PLAN_GLOBAL_BATCH:
            raise _UsageError("--global-batch-size is required")
        args.global_batch_size = PLAN_GLOBAL_BATCH[args.model]
    if args.gpus is None:
        raise _UsageError("--gpus is required (total number of GPUs)")
    gbps = 1e9
    cluster = ClusterSpec.of(
        args.gpu, args.gpus, args.gpus_per_node,
        args.intra_node_bandwidth * gbps if args.intra_node_bandwidth else None,
        args.inter_node_bandwidth * gbps if args.inter_node_bandwidth else None,
    )
    if args.bf16 and args.fp16:
        raise _UsageError("--bf16 and --fp16 are exclusive; give one of them")
    precision = "bf16" if args.bf16 else "fp16"
    optimizer = canonical_name(args.optimizer)  # the table's name of an alias (dist_muon)
    return model, cluster, TrainingSpec(args.global_batch_size, precision, args.overlap_grad_reduce, optimizer)


def _evaluate_one(args: argparse.Namespace, model: GPTSpec, cluster: ClusterSpec, train: TrainingSpec) -> Estimate:
    t, p, c = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size or 1
    if c < 1 or cluster.num_gpus % (t * c * p):
        raise _UsageError(f"--gpus {cluster.num_gpus} must be divisible by tensor x context x pipeline size "
                          f"{t}x{c}x{p}")
    v = args.virtual_pipeline_model_parallel_size or 1
    if args.pipeline_model_parallel_layout and args.virtual_pipeline_model_parallel_size is None:
        try:  # the layout string sets v, as for ptdp train
            v = max(1, layout_stage_count(args.pipeline_model_parallel_layout) // p)
        except ConfigError as e:
            raise _UsageError(str(e)) from None
    cfg = ParallelConfig(
        t, p, cluster.num_gpus // (t * c * p), v,
        args.micro_batch_size or 1, args.recompute_granularity or "none", bool(args.use_distributed_optimizer),
        args.sequence_parallel, pipeline_schedule=args.pipeline_schedule, context_parallel_size=c,
        cp_comm_type=args.cp_comm_type, pipeline_model_parallel_layout=args.pipeline_model_parallel_layout,
        enable_vocab_parallel=args.enable_vocab_parallel, disable_fb_fusion=args.disable_fb_fusion,
        sharding_strategy=args.data_parallel_sharding_strategy or "no_shard",
        distributed_optimizer_instances=args.num_distributed_optimizer_instances or 1,
        expert_model_parallel_size=args.expert_model_parallel_size or 1,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type or DEFAULT_DISPATCHER,
        overlap_moe_expert_parallel_comm=bool(args.overlap_moe_expert_parallel_comm),
    )
    reason = invalid_reason(model, cfg, cluster, train)
    if reason:
        raise _UsageError(reason)
    return evaluate(model, cfg, cluster, train)


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan (table or ``--json``); 0 on success, 2 with one line on stderr for bad input."""
    if args.virtual_pipeline_model_parallel_size is None and default_virtual_size(args.pipeline_schedule) > 1:
        args.virtual_pipeline_model_parallel_size = default_virtual_size(args.pipeline_schedule)
    try:
        model, cluster, train = _setup(args)
        if args.tensor_model_parallel_size and args.pipeline_model_parallel_size:
            best, runners, evaluated = _evaluate_one(args, model, cluster, train), [], 1
        elif args.pipeline_model_parallel_layout or args.enable_vocab_parallel or args.disable_fb_fusion:
            raise _UsageError("--pipeline-model-parallel-layout, --enable-vocab-parallel and --disable-fb-fusion "
                              "evaluate one layout: give --tensor-model-parallel-size and "
                              "--pipeline-model-parallel-size too (the search tries both ways by itself)")
        else:
            pin = lambda v: None if v is None else [v]  # noqa: E731
            space = Space(
                tensor_sizes=pin(args.tensor_model_parallel_size),
                pipeline_sizes=pin(args.pipeline_model_parallel_size),
                virtual_sizes=pin(args.virtual_pipeline_model_parallel_size),
                micro_batch_sizes=pin(args.micro_batch_size),
                recompute=pin(args.recompute_granularity) or RECOMPUTE_CHOICES,
                distributed_optimizer=pin(args.use_distributed_optimizer) or (False, True),
                sequence_parallel=args.sequence_parallel,
                pipeline_schedule=args.pipeline_schedule,
                context_sizes=pin(args.context_parallel_size),
                cp_comm_type=args.cp_comm_type,
                strategies=pin(args.data_parallel_sharding_strategy),
                instances=pin(args.num_distributed_optimizer_instances),
                expert_sizes=pin(args.expert_model_parallel_size),
                expert_tensor_sizes=pin(args.expert_tensor_parallel_size),
                dispatchers=pin(args.moe_token_dispatcher_type),
                overlap=args.overlap_moe_expert_parallel_comm,
            )
            result = search(model, cluster, train, top=args.top, space=space)
            if result.num_evaluated == 0:
                raise _UsageError("no valid layout: check --gpus against the heads, layers and --global-batch-size")
            best, runners, evaluated = result.best, result.runners_up, result.num_evaluated
    except _UsageError as err:  # one line per problem
        for line in str(err).splitlines():
            print(f"ptdp plan: error: {line}", file=sys.stderr)
        return 2
    if args.json:
        out = best.to_dict() if best is not None else {"fits": False}
        if not (args.tensor_model_parallel_size and args.pipeline_model_parallel_size):
            out["runners_up"] = [r.to_dict() for r in runners]
            out["num_evaluated"] = evaluated
        print(json.dumps(out, indent=2))
        return 0
    print(_table(model, cluster, train, best, runners, evaluated))
    return 0


_COLUMNS = ("t", "c", "p", "d", "v", "b", "m", "recompute", "zero", "vocab", "iter s", "TFLOP/s", "MFU", "bubble",
            "GiB")


def _sharded_words(c) -> str:
    return {"no_shard": "", "optim": " and shards the optimizer state over d",
            "optim_grads": " and shards optimizer state and gradients over d",
            "optim_grads_params": " and shards optimizer state, gradients and weights over d"}[c.strategy]


def _zero(c) -> str:
    """The ZeRO column: no, 1, 2 or 3 (the stage), with /K under hybrid sharding."""
    stage = {"no_shard": "no", "optim": "1", "optim_grads": "2", "optim_grads_params": "3"}[c.strategy]
    return stage + (f"/K{c.distributed_optimizer_instances}" if c.distributed_optimizer_instances > 1 else "")


def _row(rank: str, e: Estimate, moe: bool = False) -> list[str]:
    c = e.config
    return [rank, str(c.tensor_model_parallel_size), str(c.context_parallel_size), str(c.pipeline_model_parallel_size), str(c.data_parallel_size),
            *([expert_column(c)] if moe else []), str(c.virtual_pipeline_model_parallel_size), str(c.micro_batch_size), str(e.num_microbatches),
            c.recompute_granularity, _zero(c), vocab_column(c), f"{e.iteration_time_s:.2f}",
            f"{e.tflops_per_gpu:.0f}", f"{e.mfu:.0%}", f"{e.bubble_fraction:.1%}", f"{e.memory.total / GIB:.1f}",
            e.why_it_loses]


def _table(model: GPTSpec, cluster: ClusterSpec, train: TrainingSpec, best: Estimate | None,
           runners: list[Estimate], evaluated: int) -> str:
    params = model.parameter_count()
    if model.moe is not None:  # a mixture of experts: also what a token goes through
        moe_note = f" ({model.parameter_count(active=True) / 1e9:.1f}B active, E={model.moe.num_experts} k={model.moe.topk})"
    else:
        moe_note = ""
    llama = ""
    if model.swiglu or model.num_query_groups or model.untie_embeddings_and_output_weights:
        llama = (f" G={model.query_groups} ffn={model.ffn}{' SwiGLU' if model.swiglu else ''}"
                 f"{' untied' if model.untie_embeddings_and_output_weights else ''}")
    lines = [
        f"model: {params / 1e9:.1f}B parameters{moe_note}, l={model.num_layers} h={model.hidden_size} "
        f"a={model.num_attention_heads}{llama} s={model.seq_length} V={model.vocab_size}, "
        f"global batch {train.global_batch_size}" + (
            f"; attention inside documents only (--reset-attention-mask): {model.attention_length:.0f} keys per "
            "query counted, sum(l^2)/s, not s" if model.attention_length is not None else ""),
        f"cluster: {cluster.num_gpus} x {cluster.gpu.name} ({cluster.gpus_per_node}/node, "
        f"{cluster.intra_node_bandwidth / 1e9:.0f} GB/s NVLink, {cluster.inter_node_bandwidth / 1e9:.0f} GB/s network "
        f"per GPU), {train.precision}; {evaluated:,} layout(s) estimated"
        + (" (the others bounded out: docs/planner.md, The search)" if runners else ""),
    ]
    moe = model.moe is not None  # the expert layout's column: e (/etp when the experts' TP is not t)
    rows = [["", *_COLUMNS[:4], *(["e"] if moe else []), *_COLUMNS[4:], "why it loses"]]
    if best is not None:
        rows.append(_row("best" if runners or evaluated > 1 else "", best, moe))
        if not best.fits:
            rows[-1][-1] = f"does not fit: {best.memory.total / GIB:.0f} GiB > {best.memory_limit / GIB:.0f} GiB"
    else:
        lines.append("no layout fits in memory; closest:")
    rows += [_row(f"#{i}", r, moe) for i, r in enumerate(runners, start=2)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append("  ".join(cell.rjust(w) if i not in (0, len(r) - 1) else cell.ljust(w)
                               for i, (cell, w) in enumerate(zip(r, widths))).rstrip())
    if best is not None and best.fits:
        lines += ["why:", *(f"  - {line}" for line in _reasoning(model, cluster, train, best, params))]
        lines += vocab_lines(model, cluster, train, best)
    return "\n".join(lines)


def overlap_lines(c: ParallelConfig, m: int, exposed: float, total: float) -> list[str]:
    """The overlapped pairs of the chosen layout (docs/dualpipe.md): how much token movement they
    hide; none without pairs."""
    share = pair_share(c.schedule, c.pipeline_model_parallel_size, c.virtual_pipeline_model_parallel_size, m,
                       c.overlap_moe_expert_parallel_comm)
    if not share:
        return []
    how = "dualpipev" if c.schedule == "dualpipev" else f"{c.schedule} with --overlap-moe-expert-parallel-comm"
    tp = " and its layers' tensor-parallel collectives" if c.tensor_model_parallel_size > 1 else ""
    return [f"{how}: {share:.0%} of the forward and backward passes run in overlapped pairs, each microbatch's "
            f"expert dispatch and combine{tp} under the other's compute; token movement left exposed "
            f"{exposed / total:.0%} of the iteration (docs/dualpipe.md)"]


def _bubble_words(schedule: str) -> str:
    """The schedule's own bubble formula as the registry states it (the paper's (p-1)/(v·m) for 1F1B and
    interleaved, DualPipe's for dualpipev), in parentheses where it is words."""
    words = schedule_spec(schedule).bubble
    return words if words.startswith("(") else f"({words})"


def _reasoning(model: GPTSpec, cluster: ClusterSpec, train: TrainingSpec, best: Estimate, params: int) -> list[str]:
    """The best layout explained with the paper's takeaways (docs/references.md, §Configuration takeaways)."""
    from ptdp.planner.memory import model_state_bytes_per_param

    c, mem, times = best.config, best.memory, best.times
    t, p, d, v = (c.tensor_model_parallel_size, c.pipeline_model_parallel_size, c.data_parallel_size,
                  c.virtual_pipeline_model_parallel_size)
    optimizer = optimizer_spec(train.optimizer)
    state = optimizer.matrix_state_bytes  # the hidden matrices': nearly all of the parameters
    states = params * model_state_bytes_per_param(train.precision, False, 1, state)
    share = {k: seconds / best.iteration_time_s for k, seconds in (
        ("compute", times.compute), ("bubble", times.bubble), ("tp_comm", times.tp_comm), ("dp_comm", times.dp_comm))}
    tp_where = "inside one server, on NVLink" if t <= cluster.gpus_per_node else "ACROSS servers"
    cp_line = ([f"c = {c.context_parallel_size} splits each {model.seq_length}-token sequence over c ranks "
                f"({c.cp_comm_type}): activations / c, attention traffic {times.cp_comm / best.iteration_time_s:.0%} "
                "of the iteration exposed (docs/context-parallel.md)"] if c.context_parallel_size > 1 else [])
    return cp_line + expert_lines(model, c, times.ep_comm / best.iteration_time_s) + overlap_lines(
        c, best.num_microbatches, times.ep_comm, best.iteration_time_s) + [
        f"memory: {params / 1e9:.1f}B parameters x {states / params:.0f} B/param ({train.precision} + "
        f"{optimizer.words}) = "
        f"{states / GIB:,.0f} GiB of model states before sharding vs {best.memory_limit / GIB:.0f} GiB per GPU: this "
        f"layout splits the weights over t·p = {t * p} GPUs{expert_split_words(model, c)}"
        f"{_sharded_words(c)}, just enough to fit "
        "(takeaway 2)",
        f"t = {t} keeps tensor parallelism {tp_where} ({cluster.gpus_per_node} GPUs/server; takeaway 1); its "
        f"all-reduces cost {share['tp_comm']:.0%} of the iteration",
        f"p = {p} with v = {v} chunks and m = {best.num_microbatches} microbatches ({c.schedule}): bubble "
        f"{_bubble_words(c.schedule)} = {best.bubble_fraction:.1%}, {share['bubble']:.0%} of the time",
        f"d = {d} data-parallel replicas take the rest of the {cluster.num_gpus} GPUs (takeaway 2); their gradient "
        f"reduction costs {share['dp_comm']:.0%}"
        + (f" with ZeRO ({c.strategy}) sharding over {c.shards} ranks" if c.strategy != "no_shard" else ""),
        f"b = {c.micro_batch_size}, recompute {c.recompute_granularity}: {mem.total / GIB:.1f} GiB per GPU "
        f"({mem.model_states / GIB:.1f} states + {mem.activations / GIB:.1f} activations + "
        f"{mem.overhead / GIB:.1f} runtime) on pipeline rank {mem.pipeline_rank}; compute is "
        f"{share['compute']:.0%} of the {best.iteration_time_s:.2f} s iteration",
    ]
