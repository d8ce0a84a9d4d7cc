"""``ptdp plan`` prices the overlapped pairs: dualpipev and combined 1F1B hide a MoE layout's token
movement up to the other microbatch's compute, the search proposes them for MoE layouts at e > 1 only, and
combined 1F1B's bubble is that of its own timed lists (under 1f1b at p > 1 each pair waits for its
neighbour's)."""

from __future__ import annotations

import dataclasses

import pytest

from ptdp.planner.perf import iteration_times
from ptdp.planner.space import candidates
from ptdp.planner.spec import MODEL_PRESETS, ClusterSpec, GPTSpec, ParallelConfig, TrainingSpec
from ptdp.schedule.registry import bubble_fraction_formula, pair_share

_MIXTRAL = MODEL_PRESETS["mixtral-8x7b"]
MOE = dataclasses.replace(_MIXTRAL, num_layers=8, seq_length=4096, moe=dataclasses.replace(_MIXTRAL.moe, moe_layers=8))
DENSE = GPTSpec(num_layers=8, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=51200)
CLUSTER, TRAIN = ClusterSpec.of("h100-80gb", 16), TrainingSpec(32, "bf16")


def _layout(schedule: str, v: int, overlap: bool = False) -> ParallelConfig:
    return ParallelConfig(1, 2, 8, v, 1, pipeline_schedule=schedule, expert_model_parallel_size=8,
                          moe_token_dispatcher_type="alltoall", overlap_moe_expert_parallel_comm=overlap)


def test_the_pairs_hide_expert_communication_up_to_the_other_compute():
    zbv, dualpipev = (iteration_times(MOE, _layout(s, 2), CLUSTER, TRAIN) for s in ("zbv", "dualpipev"))
    plain, combined = (iteration_times(MOE, _layout("interleaved", 2, o), CLUSTER, TRAIN) for o in (False, True))
    assert 0 < dualpipev.ep_comm < zbv.ep_comm  # the passes outside pairs still expose theirs
    assert 0 < combined.ep_comm < plain.ep_comm
    assert combined.compute == plain.compute and dualpipev.compute == zbv.compute  # compute is not hidden
    assert 0 < pair_share("dualpipev", 2, 2, 16) < 1 and pair_share("zbv", 2, 2, 16) == 0


def test_combined_1f1b_pays_its_own_bubble():
    assert bubble_fraction_formula(4, 2, 8, "interleaved", True) == pytest.approx(
        bubble_fraction_formula(4, 2, 8, "interleaved"))
    assert bubble_fraction_formula(4, 1, 8, "1f1b", True) > 2.5 * bubble_fraction_formula(4, 1, 8, "1f1b")
    assert bubble_fraction_formula(1, 1, 8, "1f1b", True) == pytest.approx(0.0)  # no pipeline: nothing waits


def test_the_search_proposes_the_overlap_for_moe_layouts_moving_tokens():
    pins = {"pipeline_sizes": [2], "micro_batch_sizes": [1], "recompute": ["none"], "strategies": ["no_shard"],
            "vocab_layouts": False}
    moe = list(candidates(MOE, CLUSTER, TRAIN, **pins))
    assert any(c.schedule == "dualpipev" for c in moe)
    assert any(c.overlap_moe_expert_parallel_comm for c in moe)
    assert not any(c.overlap_moe_expert_parallel_comm or c.schedule == "dualpipev"
                   for c in moe if c.expert_model_parallel_size == 1)
    dense = list(candidates(DENSE, CLUSTER, TrainingSpec(32), **pins))
    assert dense and not any(c.overlap_moe_expert_parallel_comm or c.schedule == "dualpipev" for c in dense)
    pinned = list(candidates(MOE, CLUSTER, TRAIN, overlap=False, **pins))
    assert not any(c.overlap_moe_expert_parallel_comm or c.schedule == "dualpipev" for c in pinned)


def test_the_pairs_hide_a_dense_layouts_tensor_parallel_exchanges():
    """At t > 1 a layer run in pieces issues its four tensor-parallel collectives as exchanges: a paired pass
    hides them (with the expert movement) up to the other microbatch's compute; the embedding's and the
    logits' stay exposed, and so do the passes outside pairs. At t = 1 there is nothing to hide."""
    def times(schedule: str, t: int):
        return iteration_times(DENSE, ParallelConfig(t, 2, 8 // t, 2, 1, pipeline_schedule=schedule), CLUSTER, TRAIN)

    zbv, dualpipev = times("zbv", 2), times("dualpipev", 2)
    assert 0 < dualpipev.tp_comm < zbv.tp_comm
    assert dualpipev.compute == zbv.compute and dualpipev.ep_comm == zbv.ep_comm == 0
    assert times("dualpipev", 1).tp_comm == times("zbv", 1).tp_comm == 0
