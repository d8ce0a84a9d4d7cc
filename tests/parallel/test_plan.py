"""The resolved plan (``ptdp.parallel.plan``): every size and decision read once from the derived configuration.

``resolve_plan`` reads only the sizes and the placement of the groups it is given, so these run in one
process with stand-in groups of any world size (the real ones need that many processes; the golden and
layout tests run those through ``ptdp.train.state.setup``).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from ptdp.cli.main import build_parser
from ptdp.config import config_from_args, derive, validate
from ptdp.parallel import ParallelDims
from ptdp.parallel.plan import resolve_plan
from ptdp.schedule.registry import schedule_placement

TINY = ["--num-layers", "4", "--hidden-size", "16", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "64", "--micro-batch-size", "1", "--global-batch-size", "8", "--attention-dropout", "0"]


def _plan(world: int, *flags: str, rank: int = 0):
    config = config_from_args(build_parser().parse_args(["train", *TINY, *flags]))
    assert not validate(config, world), validate(config, world)
    config = derive(config)
    par = config.parallel
    dims = ParallelDims(world, par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                        par.context_parallel_size)
    groups = SimpleNamespace(dims=dims, placement=schedule_placement(par.schedule), rank=rank)
    return resolve_plan(config, groups)


def test_sizes_and_sequence_parallelism_decided_once():
    plan = _plan(8, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                 "--sequence-parallel", "--virtual-pipeline-model-parallel-size", "2")
    assert (plan.world, plan.t, plan.c, plan.p, plan.d, plan.v, plan.m) == (8, 2, 1, 2, 2, 2, 4)
    assert plan.sequence_parallel and plan.local_seq_length == 8  # s/t between the layers
    assert not plan.scatter_gather  # the boundary is already split along the sequence
    assert plan.schedule == "interleaved" and plan.placement == "loop" and len(plan.stages) == 4
    alone = _plan(1, "--sequence-parallel")  # t = 1: derive turned it off, and nothing turns it back on
    assert not alone.sequence_parallel and alone.local_seq_length == 16
    plain = _plan(8, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")
    assert plain.scatter_gather and plain.local_seq_length == 16


def test_zero_dtypes_and_deferred_initialisation():
    fp32 = _plan(4)
    assert fp32.zero.sharding == "no_shard" and not fp32.zero.distributed and fp32.zero.instances == 1
    assert fp32.dtype == fp32.grad_dtype == torch.float32 and not fp32.main_params and not fp32.defer_init
    zero = _plan(4, "--data-parallel-sharding-strategy", "optim_grads", "--num-distributed-optimizer-instances",
                 "2", "--bf16")
    assert zero.zero.distributed and zero.zero.instances == 2 and zero.main_params and zero.defer_init
    assert (zero.dtype, zero.grad_dtype) == (torch.bfloat16, torch.float32)
    assert _plan(4, "--use-distributed-optimizer").zero.sharding == "optim"  # Megatron's flag: ZeRO-1
    vocab = _plan(4, "--pipeline-model-parallel-size", "2", "--enable-vocab-parallel", "--bf16")
    assert vocab.vocab_parallel and vocab.vocab_divisor == 2 and not vocab.defer_init  # drawn whole at build


def test_expert_sizes_fold_over_the_same_ranks():
    plan = _plan(8, "--tensor-model-parallel-size", "2", "--num-experts", "4", "--expert-model-parallel-size", "4",
                 "--expert-tensor-parallel-size", "1")
    assert (plan.t, plan.d, plan.e, plan.etp, plan.edp) == (2, 4, 4, 1, 2)  # edp = world / (etp·e·p)
    assert _plan(4, "--tensor-model-parallel-size", "2").etp == 2  # Megatron-Core's default: etp = t


def test_every_rank_resolves_the_same_plan():
    flags = ("--tensor-model-parallel-size", "2", "--context-parallel-size", "2")
    first, other = _plan(8, *flags), _plan(8, *flags, rank=5)
    assert first == other and first.groups is not other.groups  # the groups are this rank's own
    assert dataclasses.replace(first, t=1) != other  # equality sees the sizes


def test_groups_for_other_sizes_are_refused():
    config = derive(config_from_args(build_parser().parse_args(["train", *TINY, "--tensor-model-parallel-size",
                                                                  "2"])))
    groups = SimpleNamespace(dims=ParallelDims(4, 1, 1, 1), placement="loop")
    with pytest.raises(ValueError, match="groups built for t=1"):
        resolve_plan(config, groups)
