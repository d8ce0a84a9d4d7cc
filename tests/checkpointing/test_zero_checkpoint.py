"""Checkpoints written shard by shard: a checkpoint saved at (t, p, d) = (1, 2, 4) with the
optimizer state sharded (ZeRO-1), or the model too (ZeRO-3, ``optim_grads_params``), continues
identically with no sharding at (2, 2, 1), and the reverse, against one process trained straight through
(losses and gradient norms per iteration, final weights). Plus the
box decomposition the sharded save rests on, and no rank materialising full optimizer tensors."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import TINY, assert_equivalent, assert_same_run, refused_in_process, run_layouts

from ptdp.checkpointing.sharded import flat_boxes, piece_boxes
from ptdp.parallel.placement import Placement, Split

RTOL = 1e-4
SIX = [*TINY, "--train-iters", "6", "--lr", "1e-2"]  # a large LR: a lost Adam state shows at once
P2D4 = ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"]  # 8 processes: d = 4
T2P2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
# ZeRO-3 at (1, 2, 4): the model's weights are pieces too; small buckets split parameters across ranks
Z3 = ["--pipeline-model-parallel-size", "2", "--data-parallel-sharding-strategy", "optim_grads_params",
      "--grad-bucket-size-mb", "0.001"]


def test_flat_ranges_decompose_into_boxes():
    """Every flat range of a row-major tensor is covered exactly once, in order, by the boxes."""
    rng = random.Random(0)
    for _ in range(500):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 3)))
        n = torch.Size(shape).numel()
        lo = rng.randint(0, n)
        hi = rng.randint(lo, n)
        index = torch.arange(n).view(shape)
        covered, at = torch.zeros(shape, dtype=torch.long), lo
        for offsets, sizes, flat in flat_boxes(shape, lo, hi):
            box = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].reshape(-1)
            assert flat == at and torch.equal(box, torch.arange(at, at + box.numel()))
            at += box.numel()
            covered[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))] += 1
        assert at == hi and int(covered.sum()) == hi - lo and int(covered.max()) <= 1
        assert len(flat_boxes(shape, lo, hi)) <= 2 * len(shape) - 1


def test_piece_boxes_land_in_the_global_tensor():
    """A row-parallel weight (split on dim 1) of TP rank 1 of 2: a flat range of its local piece,
    written through its boxes into the global tensor, lands where the local piece's elements are."""
    placement = Placement("w", (Split("tp", 1, 2, 1),))
    shape, offset = placement.full_shape((3, 4)), placement.offset((3, 4))
    assert shape == (3, 8) and offset == (0, 4)
    full = torch.arange(24.0).view(3, 8)
    local = full[:, 4:].reshape(-1)
    out = torch.zeros(3, 8)
    for where, view in piece_boxes(local[5:11].clone(), (3, 4), 5, offset):
        out[tuple(slice(o, o + s) for o, s in zip(where, view.shape, strict=True))] = view
    expected = torch.zeros(3, 8)
    expected.view(-1)[[full.view(-1).tolist().index(v) for v in local[5:11].tolist()]] = local[5:11]
    assert torch.equal(out, expected)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero-ckpt")
    sharded, plain, z3 = str(tmp / "sharded"), str(tmp / "plain"), str(tmp / "z3")
    return run_layouts(tmp, {
        "reference": (1, []),
        "p2d4-save": (8, [*P2D4, "--save", sharded, "--exit-interval", "3"]),
        "t2p2-load": (4, [*T2P2, "--load", sharded]),
        "t2p2-save": (4, [*T2P2, "--save", plain, "--exit-interval", "3"]),
        "p2d4-load": (8, [*P2D4, "--load", plain]),
        "z3-p2d4-save": (8, [*Z3, "--save", z3, "--exit-interval", "3"]),
        "t2p2-load-z3": (4, [*T2P2, "--load", z3]),
        "z3-p2d4-load": (8, [*Z3, "--load", plain]),
        "z2-d4": (4, ["--data-parallel-sharding-strategy", "optim_grads", "--train-iters", "2"]),
    }, base=SIX, save={"reference", "t2p2-load", "p2d4-load", "t2p2-load-z3", "z3-p2d4-load"})  # weights compared


@pytest.mark.parametrize("save, load", [("p2d4-save", "t2p2-load"), ("t2p2-save", "p2d4-load"),
                                        ("z3-p2d4-save", "t2p2-load-z3"), ("t2p2-save", "z3-p2d4-load")])
def test_checkpoint_continues_identically_in_the_other_layout(runs, save, load):
    assert [r["iteration"] for r in runs[save].records] == [1, 2, 3]
    assert_same_run(runs[save], runs["reference"], RTOL)
    assert [r["iteration"] for r in runs[load].records] == [4, 5, 6]
    assert_equivalent(runs[load], runs["reference"], RTOL)


@pytest.mark.parametrize("save, kind", [("p2d4-save", ".exp_avg"), ("z3-p2d4-save", ".exp_avg"),
                                        ("z3-p2d4-save", "model.")])
def test_sharded_checkpoint_holds_pieces(runs, save, kind):
    """The (1, 2, 4) saves wrote the Adam moments (and, at ZeRO-3, the weights) as many small chunks (each
    rank its pieces), with the global shapes a non-sharded save writes: only the chunking differs."""
    import torch.distributed.checkpoint as dcp

    def chunks(ckpt) -> dict:
        meta = dcp.FileSystemReader(str(ckpt / "iter_0000003")).read_metadata().state_dict_metadata
        return {k: m for k, m in meta.items() if kind in k and not k.startswith("rng.")}

    sharded, plain = chunks(runs[save].ckpt), chunks(runs["t2p2-save"].ckpt)
    assert sharded.keys() == plain.keys() and sharded
    assert all(sharded[k].size == plain[k].size for k in sharded)
    assert max(len(m.chunks) for m in sharded.values()) > 1


def test_metrics_show_model_states_and_peak_memory_per_rank(runs):
    """Memory you can see: every record of a window has ``model_state_bytes`` and the peak
    memory of the window per rank; ZeRO-3 holds fewer model-state bytes than ZeRO-1 at the same layout."""
    for name, world in (("p2d4-save", 8), ("z3-p2d4-save", 8), ("t2p2-save", 4)):
        last = runs[name].records[-1]
        assert len(last["peak_memory_bytes_per_rank"]) == len(last["model_state_bytes_per_rank"]) == world
        assert min(last["peak_memory_bytes_per_rank"]) > 0
        assert last["model_state_bytes"] == max(last["model_state_bytes_per_rank"]) > 0
    assert runs["z3-p2d4-save"].records[-1]["model_state_bytes"] < runs["p2d4-save"].records[-1]["model_state_bytes"]


@pytest.mark.parametrize("name, t, p, d, strategy", [
    ("t2p2-save", 2, 2, 1, "no_shard"), ("p2d4-save", 1, 2, 4, "optim"), ("z2-d4", 1, 1, 4, "optim_grads"),
    ("z3-p2d4-save", 1, 2, 4, "optim_grads_params")])
def test_plan_estimates_the_measured_model_states(runs, name, t, p, d, strategy):
    """``ptdp plan``'s model-state estimate for the fullest rank is the run's measured ``model_state_bytes``
    (distinct storages held after the step) within 5%, for every ZeRO strategy."""
    from ptdp.planner.memory import memory_per_gpu
    from ptdp.planner.spec import GPTSpec, ParallelConfig

    model = GPTSpec(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=384)  # padded
    cfg = ParallelConfig(t, p, d, sharding_strategy=strategy)
    estimate = memory_per_gpu(model, cfg, 16, "fp32").model_states
    measured = runs[name].records[-1]["model_state_bytes"]
    assert abs(estimate - measured) <= 0.05 * measured, (estimate, measured)


def test_loading_another_models_sharded_checkpoint_is_one_line(runs, capsys):
    """A ZeRO-3 checkpoint given to another model: one line naming the flag, exit 2, no traceback."""
    proc = refused_in_process(["train", *SIX, *Z3, "--hidden-size", "64", "--load",
                               str(runs["z3-p2d4-save"].ckpt), "--nproc-per-node", "8"], capsys)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(errors) == 1 and "--hidden-size 32 there, 64 here" in errors[0], errors
