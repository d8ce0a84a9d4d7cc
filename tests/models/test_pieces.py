"""The pieces engine (``ptdp.models.pieces``) and the stage that runs a model in pieces, in one process.

A model run piece by piece -- its forward cut into attention, route, dispatch, experts, combine, finish, each
piece's backward a separate autograd call -- gives the plain run's loss and gradients; so does a list whose
steady state pairs one microbatch's forward with another's backward (combined 1F1B at p = 1: the pair's
pieces alternate), with and without ``--delay-wgrad-compute``, full and selective recomputation, dense and
MoE layers, a shared expert. The engine alternates the two runs and waits on an exchange only where its
result is consumed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import validated_config

from ptdp.models import GPTModel
from ptdp.models.pieces import BackwardRun, Compute, Done, Exchange, ForwardRun, interleave, run_sequential
from ptdp.parallel.init import init_parameters
from ptdp.parallel.pipeline.executor import run_schedule
from ptdp.parallel.pipeline.module_stage import ModuleStage, PlainBatches, StageLayout
from ptdp.parallel.pipeline.overlap import overlap_handlers
from ptdp.parallel.recompute import apply_recompute
from ptdp.schedule.registry import build_schedule

M, VOCAB = 4, 64
BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--vocab-size", str(VOCAB)]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--moe-layer-freq", "2",
       "--moe-shared-expert-intermediate-size", "16"]

MLA = ["--multi-latent-attention", "--position-embedding-type", "rope", "--kv-lora-rank", "8", "--qk-head-dim", "8",
       "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--q-lora-rank", "8"]  # pieces run MLA too


class Batches(PlainBatches):
    num_microbatches = M

    def __init__(self) -> None:
        self.data = torch.randint(0, VOCAB, (M, 2, 17), generator=torch.Generator().manual_seed(3))

    def inputs(self, mb: int) -> torch.Tensor:
        return self.data[mb, :, :-1]

    def labels(self, mb: int) -> torch.Tensor:
        return self.data[mb, :, 1:]


def loss_fn(y: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    return F.cross_entropy(y.float().reshape(-1, y.shape[-1]), target.reshape(-1))


def train(flags: list[str], overlap: bool, piecewise: bool, delay: bool = False) -> tuple[float, dict]:
    cfg = validated_config([*BASE, *flags])
    model = GPTModel(cfg.model, VOCAB, VOCAB, cfg.moe)
    init_parameters(model, 1234, 0.02, cfg.model.num_layers)
    m = cfg.model
    apply_recompute(model, m.recompute_granularity, m.recompute_method, m.recompute_num_layers)
    for layer in model.modules():
        if hasattr(layer, "aux_loss_scale"):
            layer.aux_loss_scale = 1 / M
    stage = ModuleStage([model], StageLayout(0, 1, 1), Batches(), loss_fn, piecewise=piecewise,
                        delay_weight_grads=delay)
    stats = run_schedule(build_schedule("1f1b", 1, 1, M, 0, overlap=overlap), stage, None, overlap_handlers())
    return float(sum(stats.losses.values())), {n: q.grad for n, q in model.named_parameters()}


@pytest.mark.parametrize("flags", [[], MOE, [*MOE, "--recompute-granularity", "full", "--recompute-method", "uniform",
                                              "--recompute-num-layers", "2"], [*MOE, "--recompute-granularity", "selective"],
                                   [*MOE, *MLA, "--recompute-granularity", "selective"]],
                         ids=["dense", "moe", "moe-full-recompute", "moe-selective", "mla-selective"])
def test_pieces_and_overlapped_pairs_give_the_plain_run(flags):
    loss, grads = train(flags, overlap=False, piecewise=False)
    for overlap, delay in ((False, False), (True, False), (True, True)):
        got_loss, got = train(flags, overlap=overlap, piecewise=True, delay=delay)
        assert got_loss == pytest.approx(loss, rel=1e-6)
        for name, want in grads.items():
            torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-7, msg=f"{name} ({overlap}, {delay})")


class _Logged:
    """A transfer that doubles its tensors and logs when it starts and when its result is waited for."""

    def __init__(self, log: list, tag: str) -> None:
        self.log, self.tag = log, tag

    def start(self, tensors: tuple) -> Done:
        self.log.append(f"start {self.tag}")
        return _Wait(self.log, self.tag, tuple(2 * t for t in tensors))

    def start_backward(self, grads: tuple) -> Done:
        self.log.append(f"start {self.tag}-grad")
        return _Wait(self.log, f"{self.tag}-grad", tuple(2 * g for g in grads))


class _Wait(Done):
    def __init__(self, log: list, tag: str, result: tuple) -> None:
        super().__init__(result)
        self.log, self.tag = log, tag

    def wait(self) -> tuple:
        self.log.append(f"wait {self.tag}")
        return self.result


def _program(log: list, who: str) -> list:
    w = torch.tensor(3.0, requires_grad=True)
    return [Compute(lambda x: ((x * w,),), ("x",), ("a",), "first"),
            Exchange(lambda _: _Logged(log, who), "a", "b"),
            Compute(lambda b: ((b[0] * w).sin(),), ("b",), ("y",), "second")], w


def test_the_engine_alternates_two_runs_and_waits_only_where_a_result_is_needed():
    log: list = []
    steps, w_a = _program(log, "A")
    a = ForwardRun(steps, {"x": torch.tensor(0.5, requires_grad=True)})
    a.finish()
    back = BackwardRun(a, {"y": torch.tensor(1.0)})
    steps_b, _ = _program(log, "B")
    fwd = ForwardRun(steps_b, {"x": torch.tensor(0.25, requires_grad=True)})
    interleave(fwd, back)
    assert log[2:] == ["start B", "start A-grad", "wait B", "wait A-grad"], log
    # d/dx sin(2·(x·w)·w) at x = 0.5, w = 3: 2w² cos(2xw²)
    assert back.grad("x") == pytest.approx(18 * torch.cos(torch.tensor(9.0)).item())
    assert w_a.grad == pytest.approx((2 * 2 * 0.5 * 3 * torch.cos(torch.tensor(9.0))).item())
    same = run_sequential(_program([], "C")[0], {"x": torch.tensor(0.25)})["y"]
    assert fwd.value("y").item() == pytest.approx(same.item())
