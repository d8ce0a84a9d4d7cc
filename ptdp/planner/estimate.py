"""One layout's estimate (time, throughput, memory), why a layout loses against the best, and the answer
``ptdp plan`` prints from a ranking of estimates (``ranked_result``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from ptdp.models.flops import architecture, flops_per_iteration
from ptdp.planner.experts import expert_data_parallel_size
from ptdp.planner.memory import MemoryEstimate, memory_per_gpu
from ptdp.planner.perf import IterationTimes, dp_spans_nodes, iteration_times, tp_spans_nodes
from ptdp.planner.spec import ClusterSpec, GPTSpec, ParallelConfig, TrainingSpec
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
                                       self.num_microbatches, c.schedule, c.overlap_moe_expert_parallel_comm)

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


def evaluate(model: GPTSpec, cfg: ParallelConfig, cluster: ClusterSpec, train: TrainingSpec,
             memory: MemoryEstimate | None = None) -> Estimate:
    """Time, throughput and memory of one layout (assumed valid: see ``invalid_reason``); ``memory`` its
    ``memory_per_gpu`` when already known."""
    return Estimate(
        config=cfg,
        num_microbatches=cfg.num_microbatches(train.global_batch_size),
        flops_per_iteration=flops_per_iteration(
            model.num_layers, model.hidden_size, model.seq_length, model.vocab_size, train.global_batch_size,
            recompute=cfg.recompute_granularity == "full", ffn_hidden_size=model.ffn, moe=model.moe,
            mtp_num_layers=model.mtp_num_layers, attention_length=model.attention_length,
            **architecture(model),
        ),
        times=iteration_times(model, cfg, cluster, train),
        memory=memory or memory_per_gpu(model, cfg, train.global_batch_size, train.precision, train.optimizer),
        memory_limit=cluster.gpu.memory_bytes,
        peak_flops=cluster.gpu.peak_flops,
        num_gpus=cluster.num_gpus,
    )


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
    num_evaluated: int  # layouts estimated: memory, and time for those that fit (the others bounded out)


def ranked_result(ranked: list[Estimate], top: int, cluster: ClusterSpec, evaluated: int) -> SearchResult:
    """The answer from estimates ranked fitting first, fastest first: the first is the best if it fits,
    then the first of each other (t, p, c, e), ``top`` of them, each with why it loses."""
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
    return SearchResult(best, runners, evaluated)
