"""The layouts ``ptdp plan`` searches: which are valid (``invalid_reason``, naming the flag Megatron would
refuse), and all of them in one order (``cells``, ``candidates``), each dimension pinned by a flag or
searched."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import product

from ptdp.config.validate_pipeline import schedule_problems
from ptdp.planner.experts import expert_choices, expert_layout_problem
from ptdp.planner.memory import STRATEGIES
from ptdp.planner.spec import RECOMPUTE_CHOICES, ClusterSpec, GPTSpec, ParallelConfig, TrainingSpec
from ptdp.planner.stages import balanced_layout
from ptdp.planner.vocab import vocab_layout_problem, vocab_variants
from ptdp.schedule.registry import REGISTRY, default_schedule, schedule_placement


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
    if cfg.overlap_moe_expert_parallel_comm and model.moe is None:
        return "--overlap-moe-expert-parallel-comm overlaps a mixture of experts' token movement: it needs --num-experts"
    if cfg.overlap_moe_expert_parallel_comm and REGISTRY[cfg.schedule].combined is None:
        return f"--overlap-moe-expert-parallel-comm overlaps the steady state of 1f1b and interleaved, not {cfg.schedule}"
    if model.mtp_num_layers and (cfg.overlap_moe_expert_parallel_comm or REGISTRY[cfg.schedule].overlaps):
        return "--mtp-num-layers with overlapped forward-backward pairs is not supported yet"
    if cfg.recompute_granularity not in RECOMPUTE_CHOICES:
        return f"--recompute-granularity must be one of {', '.join(RECOMPUTE_CHOICES)}"
    return expert_layout_problem(model, cfg, cluster.num_gpus)  # e, etp and the dispatcher


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


@dataclass(frozen=True)
class Space:
    """The layouts ``candidates`` enumerates (``ptdp plan``'s flags): a given sequence pins that dimension.

    Context parallelism is searched (c up to 16) only for sequences of ``LONG_SEQUENCE`` tokens or more
    unless pinned: below that the s/c activations rarely pay for its attention traffic. With
    ``vocab_layouts`` each layout with p > 1 comes also with vocabulary parallelism and with the uneven
    layout that balances its stages (``vocab_variants``). A mixture of experts also searches e (dividing
    E), etp in {t, 1} and, at e > 1, both token dispatchers (``experts.expert_choices``) and, unless
    ``overlap`` or the schedule is pinned, the overlapped schedules (``overlap_variants``);
    ``overlap`` pins ``--overlap-moe-expert-parallel-comm``."""

    tensor_sizes: Sequence[int] | None = None
    pipeline_sizes: Sequence[int] | None = None
    virtual_sizes: Sequence[int] | None = None
    micro_batch_sizes: Sequence[int] | None = None
    recompute: Sequence[str] = RECOMPUTE_CHOICES
    distributed_optimizer: Sequence[bool] = (False, True)
    sequence_parallel: bool = False
    pipeline_schedule: str | None = None
    context_sizes: Sequence[int] | None = None
    cp_comm_type: str = "p2p"
    vocab_layouts: bool = True
    strategies: Sequence[str] | None = None
    instances: Sequence[int] | None = None
    expert_sizes: Sequence[int] | None = None
    expert_tensor_sizes: Sequence[int | None] | None = None
    dispatchers: Sequence[str] | None = None
    overlap: bool | None = None

    def searches_overlap(self) -> bool:
        """Whether each MoE layout also comes with its overlapped variants (``overlap_variants``)."""
        return self.pipeline_schedule is None and self.overlap is None


@dataclass(frozen=True)
class Cell:
    """The layouts of one (t, c, p, b, v, recomputation): every ZeRO sharding (outer) times every expert
    layout (inner), in ``candidates``' order; ``index`` is the cell's place in that order."""

    index: int
    t: int
    c: int
    p: int
    d: int
    b: int
    v: int
    recompute: str
    shardings: tuple[tuple[str, int], ...]
    experts: tuple[tuple[int, int | None, str], ...]
    space: Space
    layout: str | None = None  # p does not divide the layers: the balanced layout string (uneven_layout)

    def config(self, sharding: int, expert: int) -> ParallelConfig:
        (strategy, k), (e, etp, dispatcher) = self.shardings[sharding], self.experts[expert]
        s = self.space
        return ParallelConfig(self.t, self.p, self.d, self.v, self.b, self.recompute, strategy == "optim",
                              s.sequence_parallel and self.t > 1, s.pipeline_schedule, context_parallel_size=self.c,
                              cp_comm_type=s.cp_comm_type, sharding_strategy=strategy,
                              distributed_optimizer_instances=k, expert_model_parallel_size=e,
                              expert_tensor_parallel_size=etp, moe_token_dispatcher_type=dispatcher,
                              overlap_moe_expert_parallel_comm=bool(s.overlap),
                              pipeline_model_parallel_layout=self.layout)


def uneven_layout(model: GPTSpec, p: int, schedule: str | None) -> str | None:
    """For p > 1 that does not divide the layers (DeepSeek-V3's 61 on 16 stages), one layout string with a
    layer count per stage as even as it gets, the remainder away from the stages holding the embedding and
    the loss (and the MTP modules, on the last); None when p divides them (the even split)."""
    if p == 1 or model.num_layers % p == 0 or model.num_layers < p:
        return None
    last = 0.5 + model.mtp_num_layers  # the output layer and loss, and each MTP module a layer's worth
    return balanced_layout(model.num_layers, p, 1, schedule_placement(default_schedule(schedule, 1)), 1.0, 0.5,
                           last, model.mtp_num_layers)


def cells(model: GPTSpec, cluster: ClusterSpec, train: TrainingSpec, space: Space) -> Iterator[Cell]:
    """The search space's cells in ``candidates``' order (validity not checked: ``invalid_reason``)."""
    n, index = cluster.num_gpus, 0
    for t, c in _tc_pairs(model, n, space.tensor_sizes, space.context_sizes):
        for p in space.pipeline_sizes or _divisors(n // (t * c) if n % (t * c) == 0 else 1):
            if n % (t * c * p):
                continue
            d = n // (t * c * p)
            per_pipeline = train.global_batch_size // d if train.global_batch_size % d == 0 else 0
            shardings = tuple(_sharding(space.strategies, space.distributed_optimizer, space.instances, d * c))
            experts = tuple(expert_choices(model, t, c, d, space.expert_sizes, space.expert_tensor_sizes,
                                           space.dispatchers))
            layout = uneven_layout(model, p, space.pipeline_schedule) if space.vocab_layouts else None
            for b in space.micro_batch_sizes or _divisors(max(per_pipeline, 1)):
                for v in space.virtual_sizes or _divisors(model.num_layers // p if model.num_layers % p == 0 else 1):
                    for rc in space.recompute:
                        yield Cell(index, t, c, p, d, b, v, rc, shardings, experts, space, layout if v == 1 else None)
                        index += 1


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
    overlap: bool | None = None,
) -> Iterator[ParallelConfig]:
    """Every valid layout of the ``Space`` these arguments pin, each even layout followed by its
    vocabulary variants and its overlapped variants."""
    space = Space(tensor_sizes, pipeline_sizes, virtual_sizes, micro_batch_sizes, recompute, distributed_optimizer,
                  sequence_parallel, pipeline_schedule, context_sizes, cp_comm_type, vocab_layouts, strategies,
                  instances, expert_sizes, expert_tensor_sizes, dispatchers, overlap)
    for cell in cells(model, cluster, train, space):
        for i, j in product(range(len(cell.shardings)), range(len(cell.experts))):
            cfg = cell.config(i, j)
            if invalid_reason(model, cfg, cluster, train) is None:
                yield cfg
                if vocab_layouts:  # the vocabulary layers balanced two ways
                    yield from vocab_variants(model, cfg, cluster, train)
                if space.searches_overlap():
                    yield from overlap_variants(model, cfg, cluster, train)


def overlap_variants(model: GPTSpec, cfg: ParallelConfig, cluster: ClusterSpec, train: TrainingSpec
                     ) -> Iterator[ParallelConfig]:
    """A MoE layout moving tokens (e > 1) also with its expert communication overlapped: its
    schedule's combined 1F1B (``--overlap-moe-expert-parallel-comm``) and, at v = 2, dualpipev; those that are
    valid (dualpipev needs m >= 2p)."""
    if model.moe is None or cfg.expert_model_parallel_size == 1:
        return
    variants = [replace(cfg, overlap_moe_expert_parallel_comm=True)]
    if cfg.virtual_pipeline_model_parallel_size == 2 and cfg.pipeline_model_parallel_size > 1:
        variants.append(replace(cfg, pipeline_schedule="dualpipev"))
    yield from (c for c in variants if invalid_reason(model, c, cluster, train) is None)


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


