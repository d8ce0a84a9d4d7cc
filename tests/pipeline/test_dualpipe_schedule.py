"""DualPipeV and combined 1F1B as schedule data: the lists, their bubble and memory, torch's
``ScheduleDualPipeV`` as the outside reference, and the NCCL model on the overlapped pairs.

Pure, except the torch reference (its ``PipelineStage`` needs a process group: p gloo ranks build torch's
schedule; rank 0 writes the order every rank runs). In the NCCL model a list with pairs runs in pieces
through the real engine (``ptdp.simulate.nccl.pairs``), so two microbatches' expert collectives interleave
on one rank exactly as the stage issues them; the check also fails when two ranks of an expert-parallel
group interleave them differently.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import pytest
import torch
from helpers import pooled_spawn, refused_in_process

from ptdp.schedule.actions import OVERLAP, peak_stashed, plain, virtual_stage
from ptdp.schedule.registry import REGISTRY, bubble_fraction_formula, build_schedule
from ptdp.simulate.command import simulate
from ptdp.simulate.nccl.experts import record_expert_trace
from ptdp.simulate.nccl.model import check_all_send_models, check_trace, record_comm_trace
from ptdp.simulate.nccl.zero import record_zero_trace


def computes(p: int, m: int, rank: int, name: str = "dualpipev", overlap: bool = False):
    return REGISTRY[name].compute(p, 2 if name == "dualpipev" else 1, m, rank, overlap)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_every_rank_runs_each_pass_once_and_holds_pp_plus_one_activations(p):
    for m in (2 * p, 2 * p + 1, 3 * p + 2):
        for rank in range(p):
            actions = computes(p, m, rank)
            passes = Counter((a.op if a.op != "I" else "B", a.microbatch, a.chunk) for a in plain(actions))
            assert set(passes.values()) == {1} and len(passes) == 2 * m * 2 + sum(
                a.op == "W" for a in plain(actions)), (p, m, rank)
            split = {(a.microbatch, a.chunk) for a in plain(actions) if a.op == "I"}
            assert split == {(a.microbatch, a.chunk) for a in plain(actions) if a.op == "W"}
            assert peak_stashed(actions) == 2 * p + 1  # PP + 1 with PP = 2p stages (DualPipe README)
            pairs = [a for a in actions if a.op == OVERLAP]
            assert len(pairs) >= 2 * (m - 2 * p) + 1
            assert all(f.op == "F" and b.op == "B" and f.chunk != b.chunk for f, b in (a.sub for a in pairs))


@pytest.mark.parametrize("p", [2, 4, 6])
def test_the_simulated_bubble_is_the_closed_form(p):
    for m in (2 * p, 3 * p, 5 * p):
        result = simulate("dualpipev", p, 2, m)
        assert result.bubble_fraction == pytest.approx(bubble_fraction_formula(p, 2, m, "dualpipev"))
        assert result.formula == pytest.approx((p - 1) / (3 * m))  # (PP/2-1)(F&B+B-3W), F = I = W = 1
        assert max(result.peak_stashed) == 2 * p + 1


def test_dualpipev_needs_two_p_microbatches():
    with pytest.raises(ValueError, match="at least 2p = 8"):
        build_schedule("dualpipev", 4, 2, 7, 0)


@pytest.mark.parametrize("name, v", [("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
def test_combined_lists_overlap_two_microbatches_and_run_the_same_passes(name, v):
    for p in (1, 2, 4) if name == "1f1b" else (2, 4):
        for m in (p, 2 * p, 3 * p):
            for rank in range(p):
                plain_list = REGISTRY[name].compute(p, v, m, rank)
                combined = REGISTRY[name].compute(p, v, m, rank, overlap=True)
                assert Counter(plain(combined)) == Counter(plain_list)
                for f, b in (a.sub for a in combined if a.op == OVERLAP):
                    assert (f.microbatch, f.chunk) != (b.microbatch, b.chunk)
            if m >= 2 * p:
                assert any(a.op == OVERLAP for a in REGISTRY[name].compute(p, v, m, 0, overlap=True))


# ------------------------------------------------------------------------- torch.distributed.pipelining


def _torch_orders(rank: int, world: int, m: int, out: str) -> None:
    from torch import nn
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    stages = [PipelineStage(nn.Linear(4, 4), virtual_stage(rank, c, world, "v"), 2 * world, torch.device("cpu"))
              for c in range(2)]
    schedule = ScheduleDualPipeV(stages, m, loss_fn=lambda y, t: y.sum())
    if rank == 0:
        def passes(action) -> list:  # an overlapped pair lists its two passes
            subs = action.sub_actions or (action,)
            return [[a.stage_index, a.microbatch_index, TORCH_PASS[a.computation_type.name]] for a in subs]

        orders = {r: [passes(a) for a in schedule.pipeline_order[r] if a is not None] for r in range(world)}
        with open(out, "w") as f:
            json.dump(orders, f)


TORCH_PASS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


@pytest.mark.parametrize("p, m", [(2, 4), (2, 7), (4, 8), (4, 11)])
def test_the_same_passes_in_the_same_order_as_torch_schedule_dualpipev(tmp_path, p, m):
    out = tmp_path / "orders.json"
    pooled_spawn(_torch_orders, p, tmp_path, m, str(out))
    theirs = json.loads(out.read_text())
    for rank in range(p):
        ours = [[[virtual_stage(rank, part.chunk, p, "v"), part.microbatch, part.op] for part in a.parts]
                for a in computes(p, m, rank)]
        assert ours == theirs[str(rank)], rank  # the same pairs and passes in the same order
        assert Counter(map(tuple, sum(ours, []))) == Counter(map(tuple, sum(theirs[str(rank)], [])))


# ----------------------------------------------------------------------------------------- NCCL model


def assert_safe(trace: dict, *what) -> None:
    for model, problems in check_all_send_models(trace).items():
        assert not problems, (what, model, problems[:3])


@pytest.mark.parametrize("p", [2, 4])
def test_dualpipev_pipeline_zero3_and_vocab_collectives_are_deadlock_free(p):
    for m in (2 * p, 3 * p + 1):
        for forward_only in (False, True):
            for barriers in (0, 1, 2):
                for per_direction in (False, True):
                    assert_safe(record_comm_trace("dualpipev", p, 2, m, forward_only, per_direction=per_direction,
                                                  vocab_barriers=barriers), m, forward_only, barriers)
                for reshard in (False, True):
                    assert_safe(record_zero_trace("dualpipev", p, 2, m, reshard, forward_only=forward_only,
                                                  vocab_barriers=barriers), m, forward_only, barriers, reshard)


CASES = [("alltoall", False, 2, False, None), ("allgather", True, 2, False, "optim_grads_params"),
         ("alltoall", True, 4, False, "optim_grads_params"), ("allgather", False, 4, True, None)]


@pytest.mark.parametrize("name, v, overlap", [("dualpipev", 2, False), ("1f1b", 1, True), ("interleaved", 2, True)])
@pytest.mark.parametrize("p", [2, 4])
def test_interleaved_expert_collectives_agree_on_every_rank_of_a_group(name, v, overlap, p):
    """Two microbatches' dispatch and combine interleave on one rank; training and forward-only, both
    dispatchers, recomputation, expert tensor parallelism, ZeRO-3 over the dense and expert groups."""
    for m in (2 * p, 3 * p):
        for forward_only in (False, True):
            for dispatcher, recompute, pipelines, etp, zero in CASES:
                trace = record_expert_trace(name, p, v, m, pipelines=pipelines, moe_layers=2, dispatcher=dispatcher,
                                            recompute=recompute, forward_only=forward_only, expert_tensor=etp,
                                            zero=zero, overlap=overlap)
                assert_safe(trace, name, m, forward_only, dispatcher, recompute, etp, zero)


def test_a_pair_really_interleaves_the_two_microbatches_collectives():
    trace = record_expert_trace("dualpipev", 2, 2, 4, pipelines=2, moe_layers=2)
    issued = [op["msg"] for e in trace["ranks"][0] if e.get("comm") == "ep" for op in e["issue"][:1]]
    # rank 0's first pair: F3 on chunk 0 (stage 0) with B1 on chunk 1 (stage 3)
    owners = [(mb, stage) for name, mb, stage in issued
              if (mb, stage) == (3, 0) and name.startswith("ep F:") or (mb, stage) == (1, 3) and name.startswith("ep B:")]
    assert len(set(owners)) == 2
    switches = sum(a != b for a, b in zip(owners, owners[1:]))
    assert switches >= 3, owners  # not all of one microbatch, then all of the other


def test_ranks_interleaving_differently_are_caught():
    """One rank of an expert-parallel group issues its pair's collectives in the other order: a mismatch."""
    trace = record_expert_trace("dualpipev", 2, 2, 4, pipelines=2, moe_layers=1)
    events = trace["ranks"][2]  # pipeline 1's rank 0, in an expert-parallel group with pipeline 0's rank 0
    ep = [i for i, e in enumerate(events) if e.get("comm") == "ep"]
    for i, j in zip(ep, ep[1:]):
        a, b = events[i]["issue"][0]["msg"], events[j]["issue"][0]["msg"]
        if (a[1], a[2]) != (b[1], b[2]):
            events[i], events[j] = events[j], events[i]
            break
    else:
        pytest.fail("no two adjacent collectives of different microbatches")
    problems = check_trace(trace, sends_wait_for_receive=True)
    assert any(line.startswith(("mismatch", "deadlock")) for line in problems), problems


def test_the_nccl_model_mirrors_the_real_layer_pieces():
    """``ptdp.simulate.nccl.pairs`` cuts a MoE layer where the real one does (names and kinds, in order)."""
    from helpers import validated_config

    from ptdp.models import GPTModel
    from ptdp.models.pieces import Exchange
    from ptdp.parallel.pipeline.program import chunk_program as real_program
    from ptdp.simulate.nccl.pairs import Label, Recorder, chunk_program

    cfg = validated_config(["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length",
                            "4", "--num-experts", "2", "--vocab-size", "16"])
    with torch.device("meta"):
        model = GPTModel(cfg.model, 16, 16, cfg.moe)
    real, _ = real_program(model, "input")
    mirror, _ = chunk_program(True, True, 2, "alltoall", False, False, Recorder([]), Label("F", 0, 0))
    kinds = [[(type(s).__name__, s.name) for s in steps] for steps in (real, mirror)]
    assert kinds[0] == kinds[1]
    assert [s.name for s in real if isinstance(s, Exchange)] == ["moe_dispatch", "moe_combine"] * 2


# ------------------------------------------------------------------------------------------ bad input


BAD = [
    (["--pipeline-schedule", "dualpipev", "--global-batch-size", "4"],
     "--pipeline-schedule dualpipev needs the number of microbatches m = --global-batch-size / (--micro-batch-size x "
     "d) (4) to be at least 2 x --pipeline-model-parallel-size = 8"),
    (["--overlap-moe-expert-parallel-comm"], "--overlap-moe-expert-parallel-comm overlaps the expert dispatch"),
    (["--num-experts", "2", "--pipeline-schedule", "zbv", "--overlap-moe-expert-parallel-comm"],
     "not --pipeline-schedule zbv"),
    (["--delay-wgrad-compute"], "--delay-wgrad-compute delays weight gradients"),
    (["--pipeline-schedule", "dualpipev", "--recompute-granularity", "full", "--distribute-saved-activations"],
     "--distribute-saved-activations keeps a recomputed unit's input elsewhere"),
]


@pytest.mark.parametrize("flags, message", BAD)
def test_bad_flags_are_one_line_each(flags, message):
    from helpers import TINY

    from ptdp.config import add_config_arguments, config_from_args, validate

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    config = config_from_args(parser.parse_args([*TINY, "--micro-batch-size", "1",
                                                 "--pipeline-model-parallel-size", "4", *flags]))
    errors = validate(config, 4)
    assert any(message in line for line in errors), errors


def test_a_bad_flag_exits_2_without_a_traceback(capsys):
    from helpers import TINY

    proc = refused_in_process(["train", *TINY, "--micro-batch-size", "1", "--pipeline-model-parallel-size",
                               "4", *BAD[0][0], "--nproc-per-node", "4"], capsys)
    assert proc.returncode == 2 and BAD[0][1] in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
