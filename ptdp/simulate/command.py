"""``ptdp simulate``: run the per-rank schedules through time and draw them like the paper's figures.

The model (``ptdp.simulate.core``) runs exactly the action lists the executor runs (``ptdp.schedule.registry``).

Bubble fraction follows the paper (docs/references.md, §Schedules): idle time over busy time, so that GPipe and
1F1B give (p-1)/m and interleaved (p-1)/(v·m) in the ideal case; ``idle_fraction`` is idle over total.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from ptdp.config import ConfigError, ModelConfig, ParallelConfig, add_field_arguments
from ptdp.config.validate_pipeline import layout_stage_count, layout_stages, schedule_problems
from ptdp.models.flops import window_layer_costs
from ptdp.planner.vocab import vocab_pass_times
from ptdp.schedule.actions import Action
from ptdp.schedule.layout import stage_work
from ptdp.schedule.registry import REGISTRY, build_schedule, default_schedule, default_virtual_size
from ptdp.simulate.core import SimulationResult, run_lists
from ptdp.simulate.draw import NeedsMatplotlib, draw
from ptdp.simulate.vocab import simulate_vocab  # S, T and the barriers


def simulate(
    schedule: str | Sequence[Sequence[Action]],
    p: int,
    v: int,
    m: int,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
    p2p_time: float = 0.0,
    weight_grad_fraction: float = 0.5,
    stage_scale: Sequence[float] | None = None,
    overlap: bool = False,
) -> SimulationResult:
    """Simulate a named schedule (built with ``build_schedule``; ``overlap``: its combined-1F1B variant,
    ``--overlap-moe-expert-parallel-comm``) or given per-rank action lists.

    ``stage_scale[s]`` multiplies virtual stage s's compute times (an uneven layout, the vocabulary layers:
    ``stage_scales``); None: every stage costs the same.

    Raises RuntimeError if the lists deadlock (an input that is never produced or sent).
    """
    name = schedule if isinstance(schedule, str) else "custom"
    lists = [build_schedule(schedule, p, v, m, r, overlap=overlap) for r in range(p)] if isinstance(schedule, str) \
        else schedule
    return run_lists(name, lists, p, v, m, (forward_time, backward_time, p2p_time, weight_grad_fraction), stage_scale)


def stage_scales(args: argparse.Namespace) -> list[float] | None:
    """Per virtual stage, its compute time over an even stage's: from ``--num-layers`` and the layout flags,
    plus ``--embedding-cost`` / ``--output-layer-cost`` (in layers) where the vocabulary layers live, or
    1/p of them on every rank with ``--enable-vocab-parallel``. None when no layer count is given; ValueError
    naming the flag when the layout flags do not add up."""
    if args.num_layers is None:
        if args.embedding_cost or args.output_layer_cost or args.pipeline_model_parallel_layout:
            raise ValueError("--embedding-cost, --output-layer-cost and the layout flags need --num-layers")
        if getattr(args, "window_size", None) is not None:
            raise ValueError("--window-size needs --num-layers (each layer is priced by its window)")
        return None
    p, v = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    try:
        stages = layout_stages(args.num_layers, p, v, args.decoder_first_pipeline_num_layers,
                               args.decoder_last_pipeline_num_layers, args.account_for_embedding_in_pipeline_split,
                               args.account_for_loss_in_pipeline_split, args.pipeline_model_parallel_layout,
                               args.pipeline_schedule)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    work = stage_work(stages, p, args.embedding_cost, args.output_layer_cost, args.enable_vocab_parallel,
                      window_costs(args))
    return [w / (args.num_layers / (p * v)) for w in work]


WINDOW_SHAPE = ("window_size", "window_attn_skip_freq", "seq_length", "hidden_size", "num_attention_heads",
                "ffn_hidden_size")


def window_costs(args: argparse.Namespace) -> list[float] | None:
    """Per layer its time over a whole-context layer's under ``--window-size`` (min(w, s) keys per query,
    ``ptdp.models.flops.window_layer_costs``; the shape flags default to ``ptdp train``'s), None without
    windows; ValueError naming the flag for a pattern it cannot read."""
    if getattr(args, "window_size", None) is None:
        if getattr(args, "window_attn_skip_freq", None) is not None:
            raise ValueError("--window-attn-skip-freq needs --window-size")
        return None
    if args.window_size < 1:
        raise ValueError(f"--window-size must be >= 1, got {args.window_size}")
    shape = {name: getattr(args, name) for name in WINDOW_SHAPE if getattr(args, name) is not None}
    return window_layer_costs(ModelConfig(num_layers=args.num_layers, **shape))


# ---------------------------------------------------------------------------------------------------- CLI


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``ptdp simulate`` (times are per whole pipeline stage, in any unit)."""
    add_field_arguments(parser, ParallelConfig, ("pipeline_schedule", "pipeline_model_parallel_size",
                                                 "virtual_pipeline_model_parallel_size",
                                                 "overlap_moe_expert_parallel_comm"),
                        pipeline_schedule="1f1b", pipeline_model_parallel_size=4,
                        overlap_moe_expert_parallel_comm=False)  # ``ptdp train``'s flags
    # uneven layouts and the vocabulary layers (times then per even stage of --num-layers / (p·v))
    add_field_arguments(parser, ParallelConfig, (
        "pipeline_model_parallel_layout", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
        "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split", "enable_vocab_parallel",
        "disable_fb_fusion"), account_for_embedding_in_pipeline_split=False, account_for_loss_in_pipeline_split=False,
        enable_vocab_parallel=False, disable_fb_fusion=False)
    add_field_arguments(parser, ModelConfig, ("num_layers",), overrides={"num_layers": {"help": "transformer "
                        "layers: with it, each stage costs its layers (an uneven layout is drawn uneven) and "
                        "--forward-time is an even stage's"}})  # train's flag, not given unless given
    add_field_arguments(parser, ModelConfig, WINDOW_SHAPE)  # sliding windows: a layer costs its window's FLOPs
    parser.add_argument("--embedding-cost", type=float, default=0.0, help="the input embedding's time in "
                        "transformer layers (with --num-layers; default 0)")
    parser.add_argument("--output-layer-cost", type=float, default=0.0, help="the output layer's and the loss's "
                        "time in transformer layers (with --num-layers; default 0)")
    parser.add_argument("--num-microbatches", type=int, default=8, metavar="M")
    parser.add_argument("--forward-time", type=float, default=1.0, help="t_f of a whole stage (default 1)")
    parser.add_argument("--backward-time", type=float, default=2.0, help="t_b of a whole stage (default 2)")
    parser.add_argument("--p2p-time", type=float, default=0.0, help="one send/receive (default 0)")
    parser.add_argument("--out", help="draw the timeline to this .svg file (or .png / .pdf, with matplotlib: "
                        "pip install 'ptdp[plot]')")
    parser.add_argument("--json", action="store_true", help="print one JSON object, timelines included")
    parser.add_argument("--comm-trace", metavar="FILE.json",
                        help="write the p2p calls and waits the executor makes for this schedule and check "
                             "them against the NCCL model (exit 1 naming the stuck ranks if they can hang)")
    parser.add_argument("--forward-only", action="store_true",
                        help="with --comm-trace: the forward-only list of evaluation")


def _usage_error(args: argparse.Namespace) -> str | None:
    if args.virtual_pipeline_model_parallel_size is None and args.pipeline_model_parallel_layout:
        try:  # the layout string sets v, as for ptdp train
            args.virtual_pipeline_model_parallel_size = max(
                1, layout_stage_count(args.pipeline_model_parallel_layout) // args.pipeline_model_parallel_size)
        except ConfigError as err:
            return str(err)
    if args.virtual_pipeline_model_parallel_size is None:
        args.virtual_pipeline_model_parallel_size = default_virtual_size(args.pipeline_schedule)
    p, v, m = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size, args.num_microbatches
    for flag, value in (("--pipeline-model-parallel-size", p), ("--virtual-pipeline-model-parallel-size", v),
                        ("--num-microbatches", m), ("--num-layers", 1 if args.num_layers is None else args.num_layers)):
        if value < 1:
            return f"{flag} must be >= 1, got {value}"
    if args.forward_time <= 0 or args.backward_time <= 0:
        return "--forward-time and --backward-time must be > 0"
    if args.p2p_time < 0:
        return f"--p2p-time must be >= 0, got {args.p2p_time}"
    problems = schedule_problems(args.pipeline_schedule, p, v, m, "--num-microbatches", single_stage_ok=True)
    if problems:  # the schedule's own constraints (ptdp.config.validate_pipeline)
        return problems[0]
    if args.disable_fb_fusion and not args.enable_vocab_parallel:
        return "--disable-fb-fusion needs --enable-vocab-parallel"
    if args.enable_vocab_parallel and p < 2:
        return f"--enable-vocab-parallel needs --pipeline-model-parallel-size > 1, got {p}"
    if args.forward_only and not args.comm_trace:
        return "--forward-only needs --comm-trace FILE.json"
    if args.overlap_moe_expert_parallel_comm and REGISTRY[default_schedule(args.pipeline_schedule, v)].combined is None:
        return (f"--overlap-moe-expert-parallel-comm overlaps the steady state of 1f1b and interleaved, not "
                f"--pipeline-schedule {args.pipeline_schedule}")
    if args.overlap_moe_expert_parallel_comm and args.enable_vocab_parallel:
        return "--overlap-moe-expert-parallel-comm: simulate it without --enable-vocab-parallel"
    if args.out and Path(args.out).suffix.lower() not in (".png", ".svg", ".pdf"):
        return f"--out {args.out}: use a .png, .svg or .pdf file name"
    return None


def simulate_from_args(args: argparse.Namespace) -> SimulationResult:
    """``ptdp simulate``'s run: the plain schedule (``simulate``), or with ``--enable-vocab-parallel`` the
    vocabulary-parallel lists, the layers per stage from ``--num-layers`` and the layout flags and the
    passes from ``--embedding-cost`` / ``--output-layer-cost``. ValueError names the flag."""
    if not args.enable_vocab_parallel:
        return simulate(args.pipeline_schedule, args.pipeline_model_parallel_size,
                        args.virtual_pipeline_model_parallel_size, args.num_microbatches, args.forward_time,
                        args.backward_time, args.p2p_time, stage_scale=stage_scales(args),
                        overlap=args.overlap_moe_expert_parallel_comm)
    if args.num_layers is None:
        raise ValueError("--enable-vocab-parallel needs --num-layers (the vocabulary costs are in layers)")
    p, v, m = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size, args.num_microbatches
    layers_only = argparse.Namespace(**{**vars(args), "embedding_cost": 0.0, "output_layer_cost": 0.0,
                                        "enable_vocab_parallel": False})
    per_layer = (args.forward_time * p / args.num_layers, args.backward_time * p / args.num_layers)
    barriers = 2 if args.disable_fb_fusion else 1
    times = vocab_pass_times(tuple(args.embedding_cost * x for x in per_layer),
                             tuple(args.output_layer_cost * x for x in per_layer), p, m, barriers)
    return simulate_vocab(args.pipeline_schedule, p, v, m, barriers, times, args.forward_time, args.backward_time,
                          args.p2p_time, stage_scale=stage_scales(layers_only))


def run_simulate(args: argparse.Namespace) -> int:
    """Simulate, print a summary (or ``--json``) and optionally draw; 2 with one line on bad input."""
    error = _usage_error(args)
    if error is None and args.comm_trace:
        return run_comm_trace(args)
    if error is None:
        try:
            result = simulate_from_args(args)
        except ValueError as err:
            error = str(err)
    if error is not None:
        print(f"ptdp simulate: error: {error}", file=sys.stderr)
        return 2
    if args.out:
        try:
            draw(result, args.out)
        except NeedsMatplotlib as err:
            print(f"ptdp simulate: error: {err}", file=sys.stderr)
            return 2
        except OSError as err:
            print(f"ptdp simulate: error: --out {args.out}: {err.strerror}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(f"{result.schedule}: p={result.p} v={result.v} m={result.m}  total time {result.total_time:.3f}\n"
              f"bubble fraction {result.bubble_fraction:.4f} (formula {result.formula:.4f}{_closed_form(result)}), "
              f"idle {result.idle_fraction:.1%} of total\n"
              f"peak in-flight microbatch stashes per rank: {result.peak_in_flight}\n"
              f"peak activation stashes (chunk units, kept until B or W) per rank: {result.peak_stashed}\n"
              f"busy time per rank: {' '.join(f'{b:.3f}' for b in result.busy)}; slowest / median "
              f"{max(result.busy) / sorted(result.busy)[result.p // 2]:.2f}"
              + "".join(f"\n{line}" for line in result.summary_lines())
              + (f"\nwrote {args.out}" if args.out else ""))
    return 0


def _closed_form(result: SimulationResult) -> str:
    """The schedule's own bubble formula, printed beside its value (dualpipev's (p-1)(F&B+B-3W))."""
    spec = REGISTRY.get(result.schedule)
    return f" = {spec.bubble}" if spec is not None and spec.bubble_formula is not None else ""


def run_comm_trace(args: argparse.Namespace) -> int:
    """``--comm-trace``: record the executor's calls, write them, print the NCCL model's verdict.

    0 when deadlock-free under both send models, 1 naming the stuck ranks otherwise, 2 on bad input.
    """
    from ptdp.simulate.nccl.model import check_all_send_models, record_comm_trace, write_trace

    name, p = args.pipeline_schedule, args.pipeline_model_parallel_size
    v, m = args.virtual_pipeline_model_parallel_size, args.num_microbatches
    try:
        trace = record_comm_trace(name, p, v, m, args.forward_only, vocab_barriers=args.enable_vocab_parallel
                                  and 1 + args.disable_fb_fusion, overlap=args.overlap_moe_expert_parallel_comm)
        write_trace(trace, args.comm_trace)
    except ValueError as err:
        print(f"ptdp simulate: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"ptdp simulate: error: --comm-trace {args.comm_trace}: {err.strerror}", file=sys.stderr)
        return 2
    verdicts = check_all_send_models(trace)
    what = f"{name} p={p} v={v} m={m}{' forward-only' if args.forward_only else ''}"
    issues = sum("issue" in e for events in trace["ranks"] for e in events)
    if not any(verdicts.values()):
        print(f"{what}: deadlock-free under the NCCL model ({' and '.join(verdicts)}); "
              f"{issues} batched p2p calls; wrote {args.comm_trace}")
        return 0
    for model, problems in verdicts.items():
        for problem in problems:
            print(f"{what} ({model}): {problem}")
    print(f"wrote {args.comm_trace}")
    return 1
