"""What ``ptdp plan`` tries against the vocabulary imbalance, and how it says what it picked.

For every layout with p > 1 the search also evaluates

* vocabulary parallelism (``--enable-vocab-parallel``) with one barrier (``--disable-fb-fusion``, two
  barriers, is one microbatch of activations lighter but never faster in this model; ``ptdp plan
  --enable-vocab-parallel --disable-fb-fusion`` evaluates it), and
* the uneven layout (a Megatron layout string) that evens out the per-rank time of this layout's own
  estimate: fewer transformer layers on the ranks that hold the embedding and the output layer
  (``ptdp.planner.stages.balanced_layout``).

The estimates (``ptdp.planner.perf``, ``ptdp.planner.memory``) then take the max over every rank, so the
variant wins only where it really shortens the slowest stage.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from ptdp.config.validate_pipeline import layout_problem
from ptdp.planner.spec import ClusterSpec, GPTSpec, ParallelConfig, TrainingSpec
from ptdp.planner.stages import balanced_layout, end_ranks
from ptdp.schedule.registry import schedule_placement


def vocab_layout_problem(model: GPTSpec, cfg: ParallelConfig) -> str | None:
    """Why the layout string, the even split or vocabulary parallelism cannot run (a flag named), or None."""
    p, v, t = (cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size,
               cfg.tensor_model_parallel_size)
    if cfg.enable_vocab_parallel and (p == 1 or model.vocab_size < p * t):
        return f"--enable-vocab-parallel needs p > 1 and a vocabulary of at least p·t = {p * t} entries"
    return layout_problem(model.num_layers, p, v, layout=cfg.pipeline_model_parallel_layout,
                          mtp_num_layers=model.mtp_num_layers)


def vocab_costs(model: GPTSpec, cfg: ParallelConfig, cluster: ClusterSpec, precision: str) -> tuple[float, float, float]:
    """Per microbatch: one transformer layer's time on a rank, and the embedding's and the output layer's
    (with the loss) extra time on the ranks that hold them, from this layout's even-split estimate."""
    from ptdp.planner.perf import rank_stage_times

    first, last = end_ranks(cfg)
    times = rank_stage_times(model, cfg, cluster, precision, [first, last])
    layers = model.num_layers / cfg.pipeline_model_parallel_size
    st = times[0]
    per_layer = (st.compute + st.recompute + st.tp_comm + st.cp_comm) / layers
    if first == last:  # a V placement: both ends on rank 0, their time already summed in its logits
        return per_layer, 0.0, st.logits
    return per_layer, times[0].logits, times[1].logits


def vocab_pass_times(embedding: tuple[float, float], output: tuple[float, float], p: int, m: int,
                     barriers: int) -> dict[str, float]:
    """Each vocabulary-parallel pass's time on one rank (what ``ptdp simulate`` draws), from the whole
    vocabulary layers' (forward, backward) times per microbatch: ``embedding`` the input embedding's,
    ``output`` the output layer's with the loss (``vocab_costs`` gives their sum; the simulator takes them in
    transformer layers). Every rank does 1/p of each. EF and EB embed all m microbatches at once. The output
    layer's three GEMMs split as ``ptdp.parallel.vocab.stage`` runs them: S the logits (and with one barrier
    also ``exp(z - max) W``, one of the two backward GEMMs), T the rest of the backward."""
    (ef, eb), (of, ob) = embedding, output
    moved = ob / 2 if barriers == 1 else 0.0
    return {"EF": m * ef / p, "EB": m * eb / p, "S": (of + moved) / p, "T": (ob - moved) / p}


def vocab_variants(model: GPTSpec, cfg: ParallelConfig, cluster: ClusterSpec,
                   train: TrainingSpec) -> Iterator[ParallelConfig]:
    """The vocabulary-parallel and the balanced-layout versions of an even layout (none when p = 1)."""
    p, t = cfg.pipeline_model_parallel_size, cfg.tensor_model_parallel_size
    if p == 1 or cfg.enable_vocab_parallel or cfg.pipeline_model_parallel_layout:
        return
    if model.vocab_size >= p * t:
        yield replace(cfg, enable_vocab_parallel=True)  # one barrier: two is never faster in this model
    layer, first, last = vocab_costs(model, cfg, cluster, train.precision)
    layout = balanced_layout(model.num_layers, p, cfg.virtual_pipeline_model_parallel_size,
                             schedule_placement(cfg.schedule), layer, first, last, model.mtp_num_layers)
    if layout is not None:
        yield replace(cfg, pipeline_model_parallel_layout=layout)


def vocab_flags(cfg: ParallelConfig) -> str:
    """The ``ptdp train`` flags of a planned layout's vocabulary handling ("" for the plain even split)."""
    if cfg.enable_vocab_parallel:
        return "--enable-vocab-parallel" + (" --disable-fb-fusion" if cfg.disable_fb_fusion else "")
    if cfg.pipeline_model_parallel_layout:
        return f"--pipeline-model-parallel-layout '{cfg.pipeline_model_parallel_layout}'"
    return ""


def vocab_column(cfg: ParallelConfig) -> str:
    """The table's short form: ``even``, ``VP`` (one barrier), ``VP2`` (two) or the layout string."""
    if cfg.enable_vocab_parallel:
        return "VP2" if cfg.disable_fb_fusion else "VP"
    return cfg.pipeline_model_parallel_layout or "even"


def vocab_lines(model: GPTSpec, cluster: ClusterSpec, train: TrainingSpec, best) -> list[str]:
    """The best layout's per-rank balance and the ``ptdp train`` flags that give it (the plan's last lines)."""
    from ptdp.planner.perf import rank_stage_times

    cfg = best.config
    if cfg.pipeline_model_parallel_size == 1:
        return []
    times = [st.total for st in rank_stage_times(model, cfg, cluster, train.precision)]
    slowest = max(times) / sorted(times)[len(times) // 2]
    flags = vocab_flags(cfg)
    lines = [f"per-rank time per microbatch (ms): {' '.join(f'{x * 1e3:.1f}' for x in times)}; slowest / median "
             f"{slowest:.2f}"]
    if flags:
        lines.append(f"vocabulary: train with {flags} (not the even split with the embedding and the output "
                     "layer on the end stages)")
    return lines + [simulate_line(model, cluster, train, cfg)]


def simulate_line(model: GPTSpec, cluster: ClusterSpec, train: TrainingSpec, cfg: ParallelConfig) -> str:
    """The ``ptdp simulate`` command that draws this layout with its vocabulary layers priced as here
    (``vocab_costs`` in transformer layers; with vocabulary parallelism, its S and T passes)."""
    even = replace(cfg, enable_vocab_parallel=False, disable_fb_fusion=False, pipeline_model_parallel_layout=None)
    layer, embedding, output = vocab_costs(model, even, cluster, train.precision)
    return (f"picture: ptdp simulate --pipeline-schedule {cfg.schedule} --pipeline-model-parallel-size "
            f"{cfg.pipeline_model_parallel_size} --virtual-pipeline-model-parallel-size "
            f"{cfg.virtual_pipeline_model_parallel_size} --num-microbatches {cfg.num_microbatches(train.global_batch_size)} "
            f"--num-layers {model.num_layers} --embedding-cost {embedding / layer:.2f} --output-layer-cost "
            f"{output / layer:.2f} {vocab_flags(cfg)} --out plan.svg").replace("  ", " ")
