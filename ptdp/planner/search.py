"""Evaluate a layout and search all valid layouts for the fastest one that fits in memory."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from itertools import product

from ptdp.config.validate_pipeline import schedule_problems
from ptdp.models.flops import architecture, flops_per_iteration
from ptdp.planner.experts import expert_choices, expert_data_parallel_size, expert_layout_problem
from ptdp.planner.memory import STRATEGIES, MemoryEstimate, memory_per_gpu
from ptdp.planner.perf import IterationTimes, dp_spans_nodes, iteration_times, tp_spans_nodes
from ptdp.planner.spec import RECOMPUTE_CHOICES, ClusterSpec, GPTSpec, ParallelConfig, TrainingSpec
from ptdp.planner.vocab import vocab_layout_problem, vocab_variants
from ptdp.runtime.hardware import GIB
from ptdp.schedule.registry import bubble_fraction_formula


@dataclass(frozen=True)
class Estimate:
    """The model's verdict on one layout."""

    config: ParallelConfig
    num_microbatches: int
    flops_per_iteration: int
    times: IterationTimes
    memory: MemoryEstimate
    memory_limit: float
    peak_flops: float
    num_gpus: int
    why_it_loses: str = field(default="", compare=False)

    @property
    def iteration_time_s(self) -> float:
        return self.times.total

    @property
    def tflops_per_gpu(self) -> float:
        """Counted FLOPs (eq. 3, recomputation included when full) per second per GPU, as the paper reports."""
        return self.flops_per_iteration / (self.iteration_time_s * self.num_gpus) / 1e12

    @property
    def mfu(self) -> float:
        return self.tflops_per_gpu * 1e12 / self.peak_flops

    @property
    def bubble_fraction(self) -> float:
        """The paper's bubble: idle time over ideal time, (p-1)/(v·m), or the schedule's own (zero bubble)."""
        c = self.config
        return bubble_fraction_formula(c.pipeline_model_parallel_size, c.virtual_pipeline_model_parallel_size,
                                       self.num_microbatches, c.schedule)

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.memory_limit

    def to_dict(self) -> dict:
        """Flat JSON-ready summary (the ``ptdp plan --json`` fields)."""
        out = asdict(self.config)
        out.update(
            sharding_strategy=self.config.strategy,
            expert_data_parallel_size=expert_data_parallel_size(self.config),
            model_state_bytes=self.memory.model_states,
            num_microbatches=self.num_microbatches,
            pipeline_schedule=self.config.schedule,
            flops_per_iteration=self.flops_per_iteration,
            iteration_time_s=self.iteration_time_s,
            tflops_per_gpu=self.tflops_per_gpu,
            mfu=self.mfu,
            bubble_fraction=self.bubble_fraction,
            memory_per_gpu_gib=self.memory.total / GIB,
            memory_breakdown_gib={
                "model_states": self.memory.model_states / GIB,
                "activations": self.memory.activations / GIB,
                "overhead": self.memory.overhead / GIB,
                "zero_step_buffers": self.memory.step_buffers / GIB,
            },
            fits=self.fits,
            time_breakdown_s=asdict(self.times),
        )
        if self.why_it_loses:
            out["why_it_loses"] = self.why_it_loses
        return out


def evaluate(model: GPTSpec, cfg: ParallelConfig, cluster: ClusterSpec, train: TrainingSpec) -> Estimate:
    """Time, throughput and memory of one layout (assumed valid: see ``is_valid``)."""
    return Estimate(
        config=cfg,
        num_microbatches=cfg.num_microbatches(train.global_batch_size),
        flops_per_iteration=flops_per_iteration(
            model.num_layers, model.hidden_size, model.seq_length, model.vocab_size, train.global_batch_size,
            recompute=cfg.recompute_granularity == "full", ffn_hidden_size=model.ffn, moe=model.moe,
            mtp_num_layers=model.mtp_num_layers, **architecture(model),
        ),
        times=iteration_times(model, cfg, cluster, train),
        memory=memory_per_gpu(model, cfg, train.global_batch_size, train.precision),
        memory_limit=cluster.gpu.memory_bytes,
        peak_flops=cluster.gpu.peak_flops,
        num_gpus=cluster.num_gpus,
    )


def invalid_reason(model: GPTSpec, cfg: ParallelConfig, cluster: ClusterSpec, train: TrainingSpec) -> str | None:
    """Why Megatron would refuse this layout (naming the flag to change), or None if it is valid."""
    t, p, d = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.data_parallel_size
    v, b = cfg.virtual_pipeline_model_parallel_size, cfg.micro_batch_size
    if min(t, p, d, v, b) < 1:
        return "all parallel sizes and --micro-batch-size must be >= 1"
    c = cfg.context_parallel_size
    if c < 1:
        return "--context-parallel-size must be >= 1"
    if t * c * p * d != cluster.num_gpus:
        return f"--gpus {cluster.num_gpus} is not divisible by tensor x context x pipeline size {t}x{c}x{p}"
    if c > 1 and model.seq_length % (2 * c):
        return f"--context-parallel-size {c} needs --seq-length divisible by 2c = {2 * c}"
    if c > 1 and cfg.cp_comm_type == "a2a" and (model.num_attention_heads // t) % c:
        return f"--cp-comm-type a2a needs the local heads a/t divisible by --context-parallel-size {c}"
    if model.num_attention_heads % t or model.hidden_size % t or model.ffn % t:
        return f"--tensor-model-parallel-size {t} must divide the heads, hidden and ffn sizes"
    if model.query_groups % t:
        return f"--tensor-model-parallel-size {t} must divide --num-query-groups {model.query_groups}"
    layout_problem = vocab_layout_problem(model, cfg)
    if layout_problem:
        return layout_problem
    if train.global_batch_size % (b * d):
        return (f"--global-batch-size {train.global_batch_size} must be divisible by micro-batch x data-parallel"
                f" size {b}x{d}")
    problems = schedule_problems(cfg.pipeline_schedule, p, v, cfg.num_microbatches(train.global_batch_size))
    if problems:  # the schedule's own constraints (ptdp.schedule.registry)
        return problems[0]
    if cfg.recompute_granularity not in RECOMPUTE_CHOICES:
        return f"--recompute-granularity must be one of {', '.join(RECOMPUTE_CHOICES)}"
    return expert_layout_problem(model, cfg, cluster.num_gpus)  # issue 25: e, etp and the dispatcher


LONG_SEQUENCE = 16384


def _tc_pairs(model: GPTSpec, n: int, tensor_sizes: Sequence[int] | None,
              context_sizes: Sequence[int] | None) -> Iterator[tuple[int, int]]:
    for t in tensor_sizes or _divisors(n):
        searched = [c for c in _divisors(n // t if n % t == 0 else 1) if c <= 16]
        default = searched if model.seq_length >= LONG_SEQUENCE else [1]
        for c in context_sizes or default:
            yield t, c


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidates(
    model: GPTSpec,
    cluster: ClusterSpec,
    train: TrainingSpec,
    tensor_sizes: Sequence[int] | None = None,
    pipeline_sizes: Sequence[int] | None = None,
    virtual_sizes: Sequence[int] | None = None,
    micro_batch_sizes: Sequence[int] | None = None,
    recompute: Sequence[str] = RECOMPUTE_CHOICES,
    distributed_optimizer: Sequence[bool] = (False, True),
    sequence_parallel: bool = False,
    pipeline_schedule: str | None = None,
    context_sizes: Sequence[int] | None = None,
    cp_comm_type: str = "p2p",
    vocab_layouts: bool = True,
    strategies: Sequence[str] | None = None,
    instances: Sequence[int] | None = None,
    expert_sizes: Sequence[int] | None = None,
    expert_tensor_sizes: Sequence[int | None] | None = None,
    dispatchers: Sequence[str] | None = None,
) -> Iterator[ParallelConfig]:
    """Every valid layout; a given sequence pins that dimension to its values. Context parallelism is
    searched (c up to 16) only for sequences of ``LONG_SEQUENCE`` tokens or more unless pinned: below
    that the s/c activations rarely pay for its attention traffic. With ``vocab_layouts`` each layout with
    p > 1 comes also with vocabulary parallelism and with the uneven layout that balances its stages
    (``vocab_variants``). A mixture of experts also searches e (dividing E), etp in {t, 1} and, at e > 1,
    both token dispatchers (``experts.expert_choices``)."""
    n = cluster.num_gpus
    for t, c in _tc_pairs(model, n, tensor_sizes, context_sizes):
        for p in pipeline_sizes or _divisors(n // (t * c) if n % (t * c) == 0 else 1):
            if n % (t * c * p):
                continue
            d = n // (t * c * p)
            per_pipeline = train.global_batch_size // d if train.global_batch_size % d == 0 else 0
            for b in micro_batch_sizes or _divisors(max(per_pipeline, 1)):
                for v in virtual_sizes or _divisors(model.num_layers // p if model.num_layers % p == 0 else 1):
                    for rc in recompute:
                        for (strategy, k), (e, etp, dispatcher) in product(
                                _sharding(strategies, distributed_optimizer, instances, d * c),
                                list(expert_choices(model, t, c, d, expert_sizes, expert_tensor_sizes, dispatchers))):
                            cfg = ParallelConfig(t, p, d, v, b, rc, strategy == "optim", sequence_parallel and t > 1,
                                                 pipeline_schedule, context_parallel_size=c,
                                                 cp_comm_type=cp_comm_type, sharding_strategy=strategy,
                                                 distributed_optimizer_instances=k, expert_model_parallel_size=e,
                                                 expert_tensor_parallel_size=etp,
                                                 moe_token_dispatcher_type=dispatcher)
                            if invalid_reason(model, cfg, cluster, train) is None:
                                yield cfg
                                if vocab_layouts:  # issue 24: the vocabulary layers balanced two ways
                                    yield from vocab_variants(model, cfg, cluster, train)


def _sharding(strategies: Sequence[str] | None, distributed_optimizer: Sequence[bool], instances: Sequence[int] | None,
              dp: int) -> Iterator[tuple[str, int]]:
    """(ZeRO strategy, hybrid instances K) to try for a dp-cp group of ``dp`` ranks: every strategy (or the
    pinned ones; ``distributed_optimizer`` pinned alone means no_shard or optim) and, for the sharded ones,
    K = 1 or the pinned K values that divide ``dp`` (nothing to shard at d·c = 1)."""
    if strategies is None:
        strategies = STRATEGIES if tuple(distributed_optimizer) == (False, True) else [
            "optim" if dopt else "no_shard" for dopt in distributed_optimizer]
    if dp == 1:
        yield strategies[0], 1
        return
    for strategy in strategies:
        for k in [1] if strategy == "no_shard" else instances or [1]:
            if k == 1 or (dp % k == 0 and dp // k > 1):
                yield strategy, k


def why_it_loses(est: Estimate, best: Estimate, cluster: ClusterSpec) -> str:
    """The one cost that grew most compared with ``best``, in words ("bubble 12%", "TP across nodes")."""
    if not est.fits:
        return f"does not fit: {est.memory.total / GIB:.0f} GiB > {est.memory_limit / GIB:.0f} GiB"
    mine, theirs = asdict(est.times), asdict(best.times)
    key = max(mine, key=lambda k: mine[k] - theirs[k])
    share = mine[key] / est.iteration_time_s
    cfg = est.config
    if key == "bubble":
        return f"bubble {est.bubble_fraction:.0%} (vs {best.bubble_fraction:.0%})"
    if key == "tp_comm":
        where = "TP across nodes" if tp_spans_nodes(cfg, cluster) else "TP all-reduce"
        return f"{where}: {share:.0%} of time"
    if key == "dp_comm":
        where = " across nodes" if dp_spans_nodes(cfg, cluster) else ""
        return f"DP gradient all-reduce{where}: {share:.0%} of time"
    if key == "recompute":
        return f"{cfg.recompute_granularity} recomputation: {share:.0%} of time"
    if key == "p2p":
        return f"pipeline p2p (v={cfg.virtual_pipeline_model_parallel_size}): {share:.0%} of time"
    if key == "optimizer":
        return f"optimizer step: {share:.0%} of time"
    if key == "cp_comm":
        return f"context-parallel {cfg.cp_comm_type} attention traffic (c={cfg.context_parallel_size}): " \
            f"{share:.0%} of time"
    if key == "logits":
        where = "split over the pipeline" if cfg.enable_vocab_parallel else "on the first/last stage"
        return f"vocabulary layers {where}: {share:.0%} of time"
    if key == "ep_comm":
        return f"MoE token {cfg.moe_token_dispatcher_type} (e={cfg.expert_model_parallel_size}): {share:.0%} of time"
    if key == "grad_accum":
        return f"per-microbatch gradient accumulation (b={cfg.micro_batch_size}): {share:.0%} of time"
    return f"smaller per-GPU GEMMs (b={cfg.micro_batch_size}, t={cfg.tensor_model_parallel_size}): " \
        f"compute {mine['compute'] / theirs['compute'] - 1:+.0%}"


@dataclass(frozen=True)
class SearchResult:
    best: Estimate | None  # None when nothing fits
    runners_up: list[Estimate]
    num_evaluated: int


def search(
    model: GPTSpec,
    cluster: ClusterSpec,
    train: TrainingSpec,
    top: int = 5,
    configs: Iterable[ParallelConfig] | None = None,
) -> SearchResult:
    """Fastest layout that fits, plus the best layout of each other (t, p, c, e) ranked, each with why it loses.

    Layouts that would be faster but do not fit come after the fitting ones.
    """
    from ptdp.data.progress import Progress  # a bar on a terminal, a line every 10 s in a log

    configs = list(candidates(model, cluster, train) if configs is None else configs)
    progress = Progress("plan", len(configs), unit="layouts")
    estimates = []
    for c in configs:
        estimates.append(evaluate(model, c, cluster, train))
        progress.update(1)
    progress.close()
    ranked = sorted(estimates, key=lambda e: (not e.fits, e.iteration_time_s))
    best = ranked[0] if ranked and ranked[0].fits else None
    def key_of(c: ParallelConfig) -> tuple[int, ...]:  # one runner-up per (t, p, c, e)
        return (c.tensor_model_parallel_size, c.pipeline_model_parallel_size, c.context_parallel_size,
                c.expert_model_parallel_size)

    seen: set[tuple[int, ...]] = set()
    if best is not None:
        seen.add(key_of(best.config))
    runners: list[Estimate] = []
    for est in ranked:
        key = key_of(est.config)
        if key in seen:
            continue
        seen.add(key)
        reference = best if best is not None else est
        runners.append(replace(est, why_it_loses=why_it_loses(est, reference, cluster)))
        if len(runners) >= top:
            break
    return SearchResult(best, runners, len(estimates))
