"""``ptdp plan``'s branch and bound (ptdp/planner/bound.py): the answer of pricing every layout,
pricing few. Checked three ways: against the full search on small spaces (each phase: groups that fit, too
few groups that fit, none), against main's answers for the README's plan commands (tests/data), and the
two bounds against every layout's estimate. The speed is benchmarks/plan_speed.py's (BENCHMARKS.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import pytest

from ptdp.planner import add_plan_arguments, run_plan
from ptdp.planner.bound import LowerBound, _layouts
from ptdp.planner.memory import memory_per_gpu
from ptdp.planner.search import Space, candidates, cells, evaluate, search
from ptdp.planner.spec import MODEL_PRESETS, ClusterSpec, GPTSpec, TrainingSpec

ANSWERS = json.loads((Path(__file__).parent / "plan_answers.json").read_text())["cases"]
SMALL_GPT = GPTSpec(num_layers=8, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=51200)
_MIXTRAL = MODEL_PRESETS["mixtral-8x7b"]
SMALL_MOE = dataclasses.replace(_MIXTRAL, num_layers=8, seq_length=4096, moe=dataclasses.replace(_MIXTRAL.moe, moe_layers=8))


def _answer(result) -> list[dict]:
    return [r.to_dict() for r in ([result.best] if result.best else [])] + [r.to_dict() for r in result.runners_up]


def _same(a, b) -> bool:
    """Equal JSON, numbers to 1e-12 (the estimates are computed by the same code either way)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, float) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0)
    return a == b


SPACES = {  # name: (model, cluster, training, pins); each small enough to price every layout
    "dense, vocabulary variants": (SMALL_GPT, ClusterSpec.of("a100-80gb", 16), TrainingSpec(64), {}),
    "moe, experts and dispatchers": (SMALL_MOE, ClusterSpec.of("h100-80gb", 16), TrainingSpec(32, "bf16"),
                                     {"pipeline_sizes": [1, 2], "micro_batch_sizes": [1, 2]}),
    "too few groups fit": (MODEL_PRESETS["llama2-7b"], ClusterSpec.of("a100-40gb", 8), TrainingSpec(16),
                           {"recompute": ["none"], "strategies": ["no_shard"]}),
    "nothing fits": (MODEL_PRESETS["gpt3-175b"], ClusterSpec.of("a100-80gb", 8), TrainingSpec(16),
                     {"micro_batch_sizes": [1, 2]}),
    "zero bubble, pinned": (SMALL_GPT, ClusterSpec.of("a100-80gb", 8), TrainingSpec(32),
                            {"pipeline_schedule": "zb-h1", "tensor_sizes": [1, 2]}),
}


@pytest.mark.parametrize("name", list(SPACES))
def test_branch_and_bound_gives_the_full_search_answer(name):
    model, cluster, train, pins = SPACES[name]
    full = search(model, cluster, train, top=5, configs=candidates(model, cluster, train, **pins))
    fast = search(model, cluster, train, top=5, space=Space(**pins))
    assert _same(_answer(fast), _answer(full)), name
    assert fast.num_evaluated < full.num_evaluated
    if name == "nothing fits":
        assert full.best is None and len(full.runners_up) == 5
    if name == "too few groups fit":  # the runners-up include layouts that do not fit: the second pass
        assert full.best is not None and any(not r.fits for r in full.runners_up)


@pytest.mark.parametrize("name", ["dense, vocabulary variants", "moe, experts and dispatchers", "zero bubble, pinned"])
def test_bounds_hold_for_every_layout(name):
    """The time and memory bounds of a cell's entry are below every one of its layouts' estimates."""
    model, cluster, train, pins = SPACES[name]
    space = Space(**pins)
    bound, checked = LowerBound(model, cluster, train, space), 0
    for cell in cells(model, cluster, train, space):
        for j in range(len(cell.experts)):
            time_bound, memory_bound = bound(cell, j), bound.memory(cell, j)
            for _, cfg in _layouts(model, cluster, train, cell, j):
                est = evaluate(model, cfg, cluster, train)
                assert time_bound <= est.iteration_time_s, cfg
                assert memory_bound <= memory_per_gpu(model, cfg, train.global_batch_size, train.precision).total
                checked += 1
    assert checked > 100


@pytest.mark.parametrize("case", ["mixtral64h100", "llama70b_512", "llama8b_moe64"])
def test_plan_answers_match_main(case, capsys):
    """``ptdp plan --json`` gives main's answer (every layout priced there: 303,012 for Mixtral-8x7B on 64
    H100s), from a few thousand estimates."""
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    argv, expected = ANSWERS[case]["argv"], ANSWERS[case]["answer"]
    assert run_plan(parser.parse_args([*argv, "--json"])) == 0
    got = json.loads(capsys.readouterr().out)
    assert got.pop("num_evaluated") < expected.pop("num_evaluated") / 4
    assert _same(got, expected)
