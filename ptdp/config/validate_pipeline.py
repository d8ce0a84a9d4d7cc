"""The pipeline flags checked, one line each naming the flag and the fix: v, the schedule, the layout, the
vocabulary.

``ptdp.schedule`` computes with plain numbers and names (p, v, m, a layout string, a schedule name) and knows
no flag: the lines a user reads live here, in the configuration, and run before the schedule computes
anything, for ``ptdp train`` (:func:`ptdp.config.validate`), ``ptdp plan`` and ``ptdp simulate`` (which share
these flags). The layout rules are Megatron-LM's (``ptdp.schedule.layout``'s docstring, docs/pipeline-layout.md).
"""

from __future__ import annotations

from ptdp.config.schema import Config, ConfigError
from ptdp.schedule.layout import SYMBOLS, Stage, expand, pipeline_stages
from ptdp.schedule.registry import REGISTRY, default_schedule, schedule_placement

LAYOUT_FLAG = "--pipeline-model-parallel-layout"
FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"
EMBEDDING_FLAG = "--account-for-embedding-in-pipeline-split"
LOSS_FLAG = "--account-for-loss-in-pipeline-split"
PER_STAGE_FLAG = "--num-layers-per-virtual-pipeline-stage"
# How ``ptdp train`` and ``ptdp plan`` set the number of microbatches m (``ptdp simulate`` passes its own flag)
MICROBATCHES = "the number of microbatches m = --global-batch-size / (--micro-batch-size x d)"


def schedule_problems(name: str | None, p: int, v: int, m: int | None, microbatches: str = MICROBATCHES,
                      single_stage_ok: bool = False) -> list[str]:
    """Every reason schedule ``name`` (None: the default for v) cannot run with (p, v, m) (m None: not known
    yet), one line each. Several chunks on a single pipeline rank build fine lists (the tests and ``ptdp
    simulate`` use them), but a training run or a plan gains nothing from them: refused unless ``single_stage_ok``."""
    resolved = default_schedule(name, v)
    if resolved not in REGISTRY:
        return [f"--pipeline-schedule {resolved!r} is unknown; choose one of {', '.join(REGISTRY)}"]
    spec = REGISTRY[resolved]
    flag, errors = f"--pipeline-schedule {resolved}", []
    if not spec.takes_chunks(v) and spec.chunks == 1:
        errors.append(f"{flag} needs 1 model chunk per rank (v=1), got v={v}; use --pipeline-schedule "
                      "interleaved with --virtual-pipeline-model-parallel-size")
    elif not spec.takes_chunks(v):
        errors.append(f"{flag} places {spec.chunks} model chunks per rank in a V: leave out "
                      f"--virtual-pipeline-model-parallel-size or set it to {spec.chunks}, got v={v}")
    if spec.placement == "v" and p < 2 and not single_stage_ok:
        errors.append(f"{flag} needs --pipeline-model-parallel-size > 1, got {p}")
    if spec.chunks is None and v > 1 and p < 2 and not single_stage_ok:
        errors.append("--virtual-pipeline-model-parallel-size needs --pipeline-model-parallel-size > 1; "
                      "model chunks interleave across pipeline ranks")
    k = spec.min_microbatches_per_p
    if m is not None and k and m < k * p:
        errors.append(f"{flag} needs {microbatches} ({m}) to be at least {k} x --pipeline-model-parallel-size "
                      f"= {k * p}; raise --global-batch-size or lower --micro-batch-size")
    elif m is not None and not spec.takes_microbatches(p, m):
        errors.append(f"{flag} needs {microbatches} ({m}) to be a multiple of --pipeline-model-parallel-size "
                      f"{p}; adjust --global-batch-size / --micro-batch-size")
    return errors


def overlap_errors(config: Config) -> list[str]:
    """``--overlap-moe-expert-parallel-comm`` and ``--delay-wgrad-compute`` (Megatron-Core's flags; the
    overlapped pairs of ``ptdp.schedule.dualpipe``) against the schedule and the model, one line each."""
    par = config.parallel
    spec = REGISTRY.get(par.schedule)
    errors = []
    if par.overlap_moe_expert_parallel_comm:
        if not config.moe.num_experts:
            errors.append("--overlap-moe-expert-parallel-comm overlaps the expert dispatch and combine of a "
                          "mixture of experts: it needs --num-experts")
        if spec is not None and spec.combined is None and not spec.overlaps:
            names = ", ".join(n for n, s in REGISTRY.items() if s.combined is not None)
            errors.append(f"--overlap-moe-expert-parallel-comm overlaps the steady state of {names}, not "
                          f"--pipeline-schedule {par.schedule}")
    pairs = par.overlap_moe_expert_parallel_comm or (spec is not None and spec.overlaps)
    for flag, on in (("--distribute-saved-activations", config.model.distribute_saved_activations),
                     ("--checkpoint-in-cpu", config.model.checkpoint_in_cpu)):
        if on and pairs:  # the pieces are checkpointed one by one (ptdp.parallel.recompute._checkpoint_steps)
            errors.append(f"{flag} keeps a recomputed unit's input elsewhere, but overlapped forward-backward "
                          "pairs recompute a layer piece by piece: drop it, or --overlap-moe-expert-parallel-comm "
                          "and dualpipev")
    if pairs and config.model.mtp_num_layers:  # MTP with pairs: the MTP modules' expert exchanges are not pieces yet
        errors.append("--mtp-num-layers with overlapped forward-backward pairs (--overlap-moe-expert-parallel-comm "
                      "or dualpipev) is not supported yet: drop one of them")
    if par.delay_wgrad_compute and not pairs:
        overlapping = ", ".join(n for n, s in REGISTRY.items() if s.overlaps)
        errors.append("--delay-wgrad-compute delays weight gradients inside overlapped forward-backward pairs: "
                      f"it needs --overlap-moe-expert-parallel-comm or --pipeline-schedule {overlapping}")
    return errors


def layout_stage_count(layout: str) -> int:
    """The virtual stages (p·v) a ``--pipeline-model-parallel-layout`` lists; ConfigError naming the flag if
    it holds a symbol other than E, t, m and L."""
    symbols = set(expand(layout).replace("|", ""))
    unknown = sorted(symbols - set(SYMBOLS))
    if unknown:
        raise ConfigError(f"{LAYOUT_FLAG} {layout!r}: unknown symbol {unknown[0]!r}; use E (embedding), t (layer), "
                          "m (MTP module), L (loss), | between stages, x*n or (...)*n to repeat")
    return expand(layout).count("|") + 1


def _string_problem(layout: str, num_layers: int, p: int, mtp_num_layers: int = 0) -> str | None:
    stages = expand(layout).split("|")
    flat = "".join(stages)
    if len(stages) % p:
        return (f"{LAYOUT_FLAG} {layout!r} has {len(stages)} stages, not a multiple of "
                f"--pipeline-model-parallel-size {p} (it lists the p x v virtual stages)")
    if flat.count("t") != num_layers:
        return (f"{LAYOUT_FLAG} {layout!r} places {flat.count('t')} transformer layers (t), but --num-layers is "
                f"{num_layers}")
    if flat.count("E") != 1 or not stages[0].startswith("E"):
        return f"{LAYOUT_FLAG} {layout!r}: the embedding E must appear once, at the start of the first stage"
    if flat.count("L") != 1 or not stages[-1].endswith("L"):
        return f"{LAYOUT_FLAG} {layout!r}: the loss L must appear once, at the end of the last stage"
    if flat.count("m") != mtp_num_layers:
        return (f"{LAYOUT_FLAG} {layout!r} places {flat.count('m')} MTP modules (m), but --mtp-num-layers is "
                f"{mtp_num_layers}")
    if flat.count("m") != stages[-1].count("m") or "mt" in stages[-1]:
        return (f"{LAYOUT_FLAG} {layout!r}: ptdp runs the MTP modules (m) on the last stage, after its layers and "
                "before L (e.g. 'tmL'); a stage of its own (Megatron's standalone 'm|L') is not supported")
    return None


def _uneven_problem(num_layers: int, p: int, v: int, first: int | None, last: int | None) -> str | None:
    for flag, value in ((FIRST_FLAG, first), (LAST_FLAG, last)):
        if value is not None and value <= 0:
            return f"{flag} must be > 0, got {value}"
        if value is not None and value % v:
            return (f"{flag} {value} must be divisible by the virtual pipeline size {v} (each of the rank's {v} "
                    "chunks gets the same number of layers)")
    middle_ranks = p - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    flags = " and ".join(f"{f} {x}" for f, x in ((FIRST_FLAG, first), (LAST_FLAG, last)) if x is not None)
    if middle_ranks < 0 or middle_layers < 0 or bool(middle_layers) != bool(middle_ranks):
        return (f"{flags} leave {middle_layers} of --num-layers {num_layers} for {max(middle_ranks, 0)} middle "
                f"pipeline ranks of --pipeline-model-parallel-size {p}: each middle rank needs layers, and layers "
                "need a middle rank")
    if middle_ranks and (middle_layers % middle_ranks or middle_layers // middle_ranks % v):
        return (f"{flags} leave {middle_layers} layers for {middle_ranks} middle pipeline ranks: they must split "
                f"evenly, into {v} equal chunk(s) per rank (the virtual size)")
    return None


def _accounted_problem(num_layers: int, p: int, v: int, embedding: bool, loss: bool) -> str | None:
    total = num_layers + embedding + loss
    names = " and ".join(f for f, on in ((EMBEDDING_FLAG, embedding), (LOSS_FLAG, loss)) if on)
    if total % (p * v):
        return (f"{names}: --num-layers {num_layers} + {embedding + loss} = {total} must be divisible by "
                f"--pipeline-model-parallel-size x virtual size = {p}x{v}")
    if total // (p * v) < max(embedding, loss):
        return f"{names}: too few layers for {p * v} virtual stages"
    return None


def layout_problem(num_layers: int, p: int, v: int, first: int | None = None, last: int | None = None,
                   account_embedding: bool = False, account_loss: bool = False,
                   layout: str | None = None, mtp_num_layers: int = 0) -> str | None:
    """Why Megatron's layout flags cannot place ``num_layers`` layers on p·v stages (one line naming the flag),
    or None: the flags combined, then the one way they choose (``ptdp.schedule.layout.pipeline_stages``)."""
    uneven, accounted = first is not None or last is not None, account_embedding or account_loss
    if layout is not None:
        given = [f for f, on in ((FIRST_FLAG, first is not None), (LAST_FLAG, last is not None),
                                 (EMBEDDING_FLAG, account_embedding), (LOSS_FLAG, account_loss)) if on]
        if given:
            return f"{LAYOUT_FLAG} places every layer itself: drop {', '.join(given)}"
        try:
            stages = layout_stage_count(layout)
        except ConfigError as e:
            return str(e)
        problem = _string_problem(layout, num_layers, p, mtp_num_layers)
        if problem is None and stages != p * v:
            problem = (f"{LAYOUT_FLAG} {layout!r} has {stages} stages, but --pipeline-model-parallel-size x "
                       f"--virtual-pipeline-model-parallel-size = {p}x{v} = {p * v}")
        return problem
    if uneven and accounted:
        return (f"{FIRST_FLAG}/{LAST_FLAG} cannot be combined with {EMBEDDING_FLAG} or {LOSS_FLAG} (as in "
                "Megatron-LM); use one way, or a --pipeline-model-parallel-layout")
    if uneven:
        return _uneven_problem(num_layers, p, v, first, last)
    if accounted:
        return _accounted_problem(num_layers, p, v, account_embedding, account_loss)
    if num_layers % (p * v):
        return (f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size x virtual size = "
                f"{p}x{v}; choose sizes so every model chunk gets the same layers, or place them with "
                f"{FIRST_FLAG}/{LAST_FLAG} or {LAYOUT_FLAG}")
    return None


def layout_stages(num_layers: int, p: int, v: int, first: int | None = None, last: int | None = None,
                  account_embedding: bool = False, account_loss: bool = False, layout: str | None = None,
                  schedule: str | None = None, mtp_num_layers: int = 0) -> list[Stage]:
    """The p·v stages the layout flags give under ``schedule`` (None: the default for v); ConfigError, one
    line naming the flag, if they do not add up."""
    problem = layout_problem(num_layers, p, v, first, last, account_embedding, account_loss, layout, mtp_num_layers)
    if problem is not None:
        raise ConfigError(problem)
    return pipeline_stages(num_layers, p, v, first, last, account_embedding, account_loss, layout,
                           schedule_placement(default_schedule(schedule, v)))


def stages_of(config: Config, p: int | None = None, v: int | None = None) -> list[Stage]:
    """:func:`layout_stages` of a configuration (its p and v unless given)."""
    par = config.parallel
    return layout_stages(config.model.num_layers, p or par.pipeline_model_parallel_size, v or par.virtual_size,
                         par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers,
                         par.account_for_embedding_in_pipeline_split, par.account_for_loss_in_pipeline_split,
                         par.pipeline_model_parallel_layout, par.schedule, config.model.mtp_num_layers or 0)


def virtual_size(config: Config) -> tuple[int | None, list[str]]:
    """Chunks per pipeline rank v, from either of Megatron's two flags (None with the problem if they
    disagree or cannot divide the layers)."""
    m, par = config.model, config.parallel
    per, p = par.num_layers_per_virtual_pipeline_stage, par.pipeline_model_parallel_size
    if par.pipeline_model_parallel_layout is not None:  # the layout string lists the p x v stages
        return layout_virtual_size(par.pipeline_model_parallel_layout, p, per,
                                   par.virtual_pipeline_model_parallel_size)
    if per is None:
        return par.virtual_size, []
    if par.decoder_first_pipeline_num_layers is not None or par.decoder_last_pipeline_num_layers is not None:
        return None, [f"{PER_STAGE_FLAG} cannot be combined with --decoder-first/last-pipeline-num-layers (as "
                      "in Megatron-LM): give --virtual-pipeline-model-parallel-size"]
    # Megatron counts the embedding and loss the --account-for-* flags place as layers here too
    layers = m.num_layers + par.account_for_embedding_in_pipeline_split + par.account_for_loss_in_pipeline_split
    if per <= 0 or layers % (per * p):
        return None, [f"{PER_STAGE_FLAG} {per} must divide --num-layers {layers} / "
                      f"--pipeline-model-parallel-size {p}"]
    if par.virtual_pipeline_model_parallel_size not in (None, layers // (per * p)):
        return None, [f"give only one of --virtual-pipeline-model-parallel-size and {PER_STAGE_FLAG}"]
    return layers // (per * p), []


def layout_virtual_size(layout: str, p: int, per: int | None, v: int | None) -> tuple[int | None, list[str]]:
    """v from a ``--pipeline-model-parallel-layout`` (its stages / p), as Megatron-LM derives it; None with
    the problem if the string does not parse or another v flag disagrees."""
    try:
        stages = layout_stage_count(layout)
    except ConfigError as e:
        return None, [str(e)]
    if per is not None:
        return None, [f"{LAYOUT_FLAG} sets v itself: drop {PER_STAGE_FLAG}"]
    if stages % p:
        return None, [f"{LAYOUT_FLAG} {layout!r} has {stages} stages, not a multiple of "
                      f"--pipeline-model-parallel-size {p} (it lists the p x v virtual stages)"]
    if v is not None and v != stages // p:
        return None, [f"{LAYOUT_FLAG} {layout!r} has {stages} stages = {stages // p} per rank, but "
                      f"--virtual-pipeline-model-parallel-size is {v}; drop it (the layout sets v)"]
    return stages // p, []


def vocab_parallel_errors(config: Config) -> list[str]:
    """``--enable-vocab-parallel`` (vocabulary parallelism, ``ptdp.schedule.vocab``) against the layout, one line each."""
    par, m = config.parallel, config.model
    if not par.enable_vocab_parallel:
        return ["--disable-fb-fusion needs --enable-vocab-parallel"] if par.disable_fb_fusion else []
    p, t = par.pipeline_model_parallel_size, par.tensor_model_parallel_size
    errors = []
    if p < 2:
        errors.append(f"--enable-vocab-parallel splits the vocabulary over pipeline ranks: it needs "
                      f"--pipeline-model-parallel-size > 1, got {p}")
    if m.vocab_size is not None and m.vocab_size < p * t:
        errors.append(f"--enable-vocab-parallel: --vocab-size {m.vocab_size} is smaller than pipeline x tensor "
                      f"parallel size {p}x{t}: every rank needs at least one vocabulary row")
    return errors
