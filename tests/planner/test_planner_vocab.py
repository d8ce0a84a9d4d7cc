"""The planner's per-stage estimates know the vocabulary layers: at V = 64k with p = 4 the even
split is unbalanced (the last rank carries the output layer and the loss, the first the embedding), and
vocabulary parallelism or an uneven layout ranks better; ``ptdp plan`` proposes them and prints the flags."""

from __future__ import annotations

import statistics
from dataclasses import replace

from ptdp.cli.main import main
from ptdp.planner.memory import rank_memory
from ptdp.planner.perf import iteration_times, rank_stage_times
from ptdp.planner.search import candidates, evaluate, search
from ptdp.planner.spec import ClusterSpec, GPTSpec, ParallelConfig, TrainingSpec
from ptdp.planner.stages import balanced_counts, rank_layers, vocab_shares
from ptdp.planner.vocab import vocab_costs, vocab_variants
from ptdp.schedule.layout import stages_from_string

# the measured case: GPT, h = 256, 8 layers, V = 65,536, p = 4 (here priced on 4 GPUs of one server)
MODEL = GPTSpec(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=1024, vocab_size=65536)
CLUSTER = ClusterSpec.of("a100-80gb", 4, gpus_per_node=4)
TRAIN = TrainingSpec(global_batch_size=64)
BASE = ParallelConfig(1, 4, 1, micro_batch_size=1)


def slowest_over_median(cfg: ParallelConfig) -> float:
    times = [st.total for st in rank_stage_times(MODEL, cfg, CLUSTER, TRAIN.precision)]
    return max(times) / statistics.median(times)


def memory_max_over_min(cfg: ParallelConfig, kind: str = "model_states") -> float:
    """Max over min across ranks of the model states (the vocabulary tables' part), or of all memory but the
    runtime overhead (1F1B's stashes unbalance that on their own: rank r keeps p - r microbatches)."""
    mem = [e.model_states if kind == "model_states" else e.total - e.overhead
           for e in rank_memory(MODEL, cfg, TRAIN.global_batch_size, TRAIN.precision)]
    return max(mem) / min(mem)


def test_even_split_at_64k_is_unbalanced_and_vocab_parallel_balances_it():
    assert slowest_over_median(BASE) > 3  # the last rank: the output layer + loss dwarf two layers
    assert memory_max_over_min(BASE) > 1.5
    vp = replace(BASE, enable_vocab_parallel=True)
    assert vocab_shares(vp, 0) == vocab_shares(vp, 3) == (0.25, 0.25)
    assert slowest_over_median(vp) < 1.15
    assert memory_max_over_min(vp) < 1.2
    assert memory_max_over_min(vp, "all") < memory_max_over_min(BASE, "all")
    base_time, vp_time = (iteration_times(MODEL, c, CLUSTER, TRAIN).total for c in (BASE, vp))
    assert vp_time < base_time / 1.5
    # two barriers: one microbatch fewer of activations, never faster
    vp2 = replace(vp, disable_fb_fusion=True)
    assert evaluate(MODEL, vp2, CLUSTER, TRAIN).memory.total < evaluate(MODEL, vp, CLUSTER, TRAIN).memory.total
    assert iteration_times(MODEL, vp2, CLUSTER, TRAIN).total >= vp_time


def test_uneven_layout_moves_layers_off_the_vocabulary_stages():
    layer, first, last = vocab_costs(MODEL, BASE, CLUSTER, TRAIN.precision)
    assert last > first > 0 and last > 2 * layer
    [variant] = [c for c in vocab_variants(MODEL, BASE, CLUSTER, TRAIN) if c.pipeline_model_parallel_layout]
    layout = variant.pipeline_model_parallel_layout
    stages = stages_from_string(layout, 8, 4)  # a layout ptdp train accepts
    assert len(stages[-1].layers) < 2 <= max(len(s.layers) for s in stages)  # fewer layers beside the loss
    assert rank_layers(8, variant) == [len(s.layers) for s in stages]
    assert slowest_over_median(variant) < slowest_over_median(BASE)
    assert evaluate(MODEL, variant, CLUSTER, TRAIN).iteration_time_s < evaluate(MODEL, BASE, CLUSTER, TRAIN).iteration_time_s


def test_balanced_counts_minimise_the_slowest_rank():
    counts = balanced_counts(8, 4, 1, "loop", 1.0, 0.0, 3.0)
    assert sum(counts) == 8 and max(c + 3 * (i == 3) for i, c in enumerate(counts)) == 3
    counts = balanced_counts(16, 4, 2, "loop", 1.0, 1.0, 1.0)  # v = 2: per rank, spread over its chunks
    loads = [counts[r] + counts[r + 4] + (r == 0) + (r == 3) for r in range(4)]
    assert sum(counts) == 16 and max(loads) - min(loads) <= 1
    assert balanced_counts(12, 4, 1, "loop", 1.0, 0.0, 0.0) == [3, 3, 3, 3]
    # a V placement: the first and the last stage both live on rank 0
    counts = balanced_counts(8, 2, 2, "v", 1.0, 1.0, 1.0)
    assert counts[0] + counts[3] < counts[1] + counts[2]


def test_search_proposes_vocabulary_parallelism_or_a_layout_when_it_wins():
    configs = list(candidates(MODEL, CLUSTER, TRAIN, tensor_sizes=[1], pipeline_sizes=[4], micro_batch_sizes=[1],
                              recompute=["none"], virtual_sizes=[1]))
    assert any(c.enable_vocab_parallel for c in configs) and any(c.pipeline_model_parallel_layout for c in configs)
    best = search(MODEL, CLUSTER, TRAIN, configs=configs).best
    assert best.config.enable_vocab_parallel or best.config.pipeline_model_parallel_layout
    # without the vocabulary layers' imbalance (a tiny vocabulary) the plain even split stays
    small = replace(MODEL, vocab_size=512)
    configs = list(candidates(small, CLUSTER, TRAIN, tensor_sizes=[1], pipeline_sizes=[4], micro_batch_sizes=[1],
                              recompute=["none"], virtual_sizes=[1]))
    best = search(small, CLUSTER, TRAIN, configs=configs).best
    assert not best.config.pipeline_model_parallel_layout


def test_plan_prints_the_flags(capsys):
    shape = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "1024",
             "--vocab-size", "65536", "--global-batch-size", "64", "--gpus", "4", "--gpus-per-node", "4",
             "--micro-batch-size", "1"]
    assert main(["plan", *shape, "--pipeline-model-parallel-size", "4"]) == 0  # search, p pinned
    out = capsys.readouterr().out
    assert "vocabulary: train with --enable-vocab-parallel" in out or "--pipeline-model-parallel-layout '" in out
    assert main(["plan", *shape, "--pipeline-model-parallel-size", "4", "--tensor-model-parallel-size", "1",
                 "--pipeline-model-parallel-layout", "Ettt|ttt|tt|L"]) == 0
    out = capsys.readouterr().out
    assert "Ettt|ttt|tt|L" in out and "per-rank time per microbatch" in out
    assert main(["plan", *shape, "--enable-vocab-parallel"]) == 2
    assert "give --tensor-model-parallel-size" in capsys.readouterr().err
    assert main(["plan", *shape, "--pipeline-model-parallel-size", "4", "--tensor-model-parallel-size", "1",
                 "--pipeline-model-parallel-layout", "Et*3|ttL"]) == 2
    assert "--pipeline-model-parallel-layout" in capsys.readouterr().err


def test_simulator_prices_the_vocabulary_layers_and_the_layout(capsys):
    from ptdp.schedule.layout import pipeline_stages, stage_work
    from ptdp.simulate.command import simulate

    even = pipeline_stages(8, 4, 1)
    assert stage_work(even, 4, 1.0, 6.0) == [3.0, 2.0, 2.0, 8.0]
    assert stage_work(even, 4, 1.0, 6.0, vocab_parallel=True) == [3.75] * 4
    uneven = stages_from_string("Ettt|ttt|tt|L", 8, 4)
    totals = {}
    for name, work in (("even", stage_work(even, 4, 1.0, 6.0)), ("uneven", stage_work(uneven, 4, 1.0, 6.0)),
                       ("vp", stage_work(even, 4, 1.0, 6.0, vocab_parallel=True)), ("none", [2.0] * 4)):
        totals[name] = simulate("1f1b", 4, 1, 8, stage_scale=[w / 2 for w in work]).total_time
    assert totals["none"] == 33.0  # (m + p - 1) * (1 + 2)
    assert totals["vp"] < totals["uneven"] < totals["even"]
    shape = ["simulate", "--pipeline-model-parallel-size", "4", "--num-layers", "8", "--output-layer-cost", "6",
             "--embedding-cost", "1"]
    assert main([*shape, "--pipeline-model-parallel-layout", "Ettt|ttt|tt|L"]) == 0
    assert "total time 85.500" in capsys.readouterr().out
    assert main([*shape, "--pipeline-model-parallel-layout", "Ettt|ttt|ttt|L"]) == 2
    assert "places 9 transformer layers" in capsys.readouterr().err
