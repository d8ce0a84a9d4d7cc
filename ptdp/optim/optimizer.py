"""The optimizer step: unscale (fp16), global-norm clip, the update rule, and hand the new weights to the model.

Two implementations behind one interface (Megatron-Core's ``MegatronOptimizer`` family):

* :class:`FP32Optimizer`: fp32 parameters, no master copy; the torch optimizer steps the model parameters
  themselves, whose ``.grad`` are the all-reduced bucket views.
* :class:`DistributedOptimizer`: fp32 *main* parameters separate from the model's (16-bit, or fp32 views
  of the flat parameter buffer). With ``--use-distributed-optimizer`` (ZeRO-1) each DP rank holds only
  the main parameters, gradients and optimizer state of its 1/d shard of every bucket, steps them, and the
  buckets are all-gathered; without it (``--bf16``/``--fp16`` alone) the "shard" is the whole bucket,
  which is Megatron's ``Float16OptimizerWithFloat16Params``.

The update rule is ``--optimizer``'s entry of ``ptdp.optim.kinds.OPTIMIZERS`` (AdamW, SGD, Muon + AdamW),
built over the tensors this rank steps; AdamW is ``torch.optim.AdamW`` on the main-parameter pieces, so its
arithmetic is torch's to the bit. Nothing here depends on which rule runs: the checkpoints ask
``kinds.state_fields`` what to save per tensor.

Weight decay applies to matrices only (not biases, not LayerNorm), as Megatron does. Memory per
parameter: docs/references.md, §Memory (e.g. bf16 params + fp32 grads: 18 -> 6 + 12/d bytes with AdamW).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ptdp.config import OptimizerConfig
from ptdp.optim import kinds
from ptdp.optim.clip_grads import clip_grads, global_grad_norm_tensor
from ptdp.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler
from ptdp.optim.kinds import Stepped
from ptdp.optim.muon import MuonLayout
from ptdp.parallel.collectives import all_gather_single
from ptdp.parallel.data.buffer import Bucket
from ptdp.parallel.data.protocol import ShardedGrads
from ptdp.parallel.placement import Placements


def build_optimizer(params: list[nn.Parameter], cfg: OptimizerConfig,
                    placements: Placements | None = None) -> kinds.Inner:
    """``--optimizer`` over whole parameters in one process (the reference the others match), with
    Megatron's decay groups: weight matrices only, not biases (the fused qkv bias is 2-D) nor norms, as
    ``placements`` records (``Placements.decays``; a plain model's parameters by their shape)."""
    return kinds.build([Stepped(p, p) for p in params], cfg, placements)


class MegatronOptimizer:
    """``step()``: unscale and check for overflow (fp16), clip the global norm, update, publish weights.

    ``norm_groups`` are the process groups the squared-norm partial sums are added over: TP and PP when
    DP replicas hold equal grads, the whole world when DP ranks hold disjoint shards.
    """

    def __init__(self, optimizer: kinds.Inner, cfg: OptimizerConfig, tp_rank: int, norm_groups: list,
                 scaler: ConstantGradScaler | DynamicGradScaler | None, placements: Placements):
        self.optimizer, self.cfg, self.tp_rank, self.placements = optimizer, cfg, tp_rank, placements
        self.norm_groups, self.scaler = norm_groups, scaler
        self.device = torch.device("cpu")  # the model's device (set by subclasses): where the norm lives
        self.skipped_iterations = 0  # fp16 overflows so far
        self.steps = 0  # updates made, the same on every rank (some may own no piece); AdamW's ``step``
        self._counts: list[bool] | None = None  # which main grads count in the norm (see _counted)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        """Multiply the loss by this before the backward (1.0 unless --fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def _main_grads(self) -> tuple[list[torch.Tensor], list[bool]]:
        """The gradients the update reads (set as its tensors' ``.grad``) and whether each counts in the norm."""
        raise NotImplementedError

    def main_grads(self) -> list[torch.Tensor]:
        """The data-parallel-reduced gradients the next :meth:`step` reads (this rank's shards when sharded):
        what a fault-tolerant replica group averages with the others (``ptdp.train.replicas``)."""
        return self._main_grads()[0]

    def _counted(self, params: Iterable[nn.Parameter]) -> list[bool]:
        """Whether each of ``params`` (one per main grad) counts in the norm on this rank: read off the
        placements once (they are fixed after set-up), not per parameter per step."""
        if self._counts is None:
            self._counts = [self.placements.counts_in_norm(p, self.tp_rank) for p in params]
        return self._counts

    def _publish_params(self) -> None:
        """Make the model parameters equal the updated main parameters (on every DP rank)."""

    def reload_model_params(self) -> None:
        """Main parameters := model parameters, after a checkpoint load (nothing to do without them)."""

    def state_fields(self, param: nn.Parameter) -> tuple[str, ...]:
        """The per-element state the update keeps for ``param`` (``kinds.state_fields``): what checkpoints hold."""
        return kinds.state_fields(self.cfg, self.placements, param)

    def pending_state_bytes(self) -> int:
        """The fp32 state the first step will allocate for the tensors that have none yet (the start-up
        summary states the steady state)."""
        return kinds.pending_state_bytes(self.optimizer, self.cfg, self.placements, self._param_of)

    def _param_of(self, tensor: torch.Tensor) -> nn.Parameter:
        """The model parameter a stepped tensor is (a piece of)."""
        return tensor

    def state_per_param(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """The logical optimizer state per parameter (checkpoints: ``ptdp.checkpointing.state``):
        ``kinds.state_fields``' tensors shaped like the parameter, and ``step``."""
        raise NotImplementedError

    def load_state_per_param(self, states: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """Inverse of :meth:`state_per_param`."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self) -> tuple[torch.Tensor, bool]:
        """One update from the DP-reduced ``main_grad`` buffers; returns (grad norm, skipped).

        The norm is a 0-dim device tensor and clipping happens on the device, so a bf16/fp32 step never
        waits for the GPU; only fp16's overflow check reads the norm on the host (it decides the step).
        """
        grads, counted = self._main_grads()
        if self.scaler is not None and self.scaler.scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / self.scaler.scale)  # a power of two: exact
        counted_grads = [g for g, c in zip(grads, counted, strict=True) if c]
        norm = global_grad_norm_tensor(counted_grads, self.norm_groups, self.device)
        if self.scaler is not None:
            found_inf = not math.isfinite(norm.item())  # the all-reduced norm: every rank agrees
            self.scaler.update(found_inf)
            if found_inf:
                self.skipped_iterations += 1
                return norm, True
        clip_grads(grads, self.cfg.clip_grad, norm)
        self.optimizer.step()
        self.steps += 1
        self._publish_params()
        return norm, False


class FP32Optimizer(MegatronOptimizer):
    """fp32 training without a master copy: the update on the model parameters (their grads are bucket views)."""

    def __init__(self, params: list[nn.Parameter], cfg: OptimizerConfig, tp_rank: int, norm_groups: list,
                 placements: Placements | None = None, layout: MuonLayout | None = None):
        self.params = [p for p in params if p.requires_grad]
        placements = Placements() if placements is None else placements
        inner = kinds.build([Stepped(p, p) for p in self.params], cfg, placements, layout)
        super().__init__(inner, cfg, tp_rank, norm_groups, None, placements)
        self.device = self.params[0].device if self.params else self.device

    @property
    def state(self):
        """torch's per-parameter state, keyed by model parameter (what checkpointing reads)."""
        return self.optimizer.state

    def _main_grads(self) -> tuple[list[torch.Tensor], list[bool]]:
        return [p.grad for p in self.params], self._counted(self.params)

    def state_per_param(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """{param: {field: tensor, "step"}} (empty before the first step)."""
        if not self.steps:
            return {}
        step = torch.tensor(float(self.steps), dtype=torch.float32)
        state = self.optimizer.state
        return {p: {**{k: state[p][k] for k in self.state_fields(p)}, "step": step.clone()} for p in self.params}

    def local_shards(self) -> list[LocalShard]:
        """Every parameter whole (nothing is sharded): see :meth:`DistributedOptimizer.local_shards`."""
        state = self.optimizer.state
        return [LocalShard(p, 0, p.numel(), p.detach().view(-1), p.detach().view(-1),
                           {k: state[p][k].view(-1) for k in self.state_fields(p) if p in state})
                for p in self.params]

    def load_state_per_param(self, states: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        steps = {int(s["step"]) for s in states.values()}
        if len(steps) > 1:
            raise ValueError(f"load_state_per_param: parameters at different steps {sorted(steps)}")
        self.steps = steps.pop() if steps else self.steps
        for p in self.params:
            if p in states:
                kinds.install_state(self.optimizer, p, {k: states[p][k] for k in self.state_fields(p)}, self.steps)


@dataclass
class LocalShard:
    """A contiguous piece of one parameter owned by this rank: see :meth:`DistributedOptimizer.local_shards`."""

    param: nn.Parameter
    start: int  # in param.view(-1) coordinates
    end: int
    model: torch.Tensor  # 1-D, model dtype, a live view
    main: torch.Tensor  # 1-D, fp32 master weights, a live view (the same as ``model`` in fp32)
    state: dict[str, torch.Tensor]  # exp_avg, exp_avg_sq (1-D, live); empty before the first step


@dataclass
class ShardPiece:
    """The part ``[start, end)`` (bucket coordinates) of ``param`` that lies in this rank's shard."""

    param: nn.Parameter
    bucket: Bucket
    start: int
    end: int
    param_offset: int  # where the param starts in the bucket
    main: torch.Tensor  # fp32 main parameter piece, 1-D

    @property
    def model_view(self) -> torch.Tensor:
        """The model-dtype values of this piece, never gathered (under ZeRO-3 a view of the bucket's
        persistent parameter shard, else of the flat parameter buffer)."""
        b = self.bucket
        return b.own_param[self.start - b.shard_start:self.end - b.shard_start]

    @property
    def grad_view(self) -> torch.Tensor:
        b = self.bucket
        return b.own_grad[self.start - b.shard_start:self.end - b.shard_start]

    @property
    def flat_range(self) -> tuple[int, int]:
        """``[start, end)`` of this piece in the flattened parameter (``param.view(-1)`` coordinates)."""
        return self.start - self.param_offset, self.end - self.param_offset

    def of(self, logical: torch.Tensor) -> torch.Tensor:
        """This piece's elements of a full tensor shaped like ``param``."""
        lo = self.start - self.param_offset
        return logical.reshape(-1)[lo:lo + self.end - self.start]


class DistributedOptimizer(MegatronOptimizer):
    """fp32 main parameters and optimizer state for this rank's shard of every bucket (see the module doc).

    The checkpoint code reads and writes the *logical* state with :meth:`state_per_param` and
    :meth:`load_state_per_param` (collectives over DP when sharded), so checkpoints do not depend on d.
    """

    def __init__(self, grads: ShardedGrads, cfg: OptimizerConfig, tp_rank: int, norm_groups: list,
                 scaler: ConstantGradScaler | DynamicGradScaler | None, placements: Placements | None = None,
                 layout: MuonLayout | None = None):
        if any(b.param_data is None for b in grads.buckets):
            raise ValueError("DistributedOptimizer needs a parameter buffer (BucketLayout(param_buffer=True))")
        self.grads = grads
        self.pieces: list[ShardPiece] = []
        for bucket in grads.buckets:
            for param, offset in zip(bucket.params, bucket.offsets, strict=True):
                start, end = max(offset, bucket.shard_start), min(offset + param.numel(), bucket.shard_end)
                if start >= end:
                    continue
                own = bucket.own_param
                model = own[start - bucket.shard_start:end - bucket.shard_start]
                main = model if model.dtype == torch.float32 else model.detach().float()  # fp32: update in place
                self.pieces.append(ShardPiece(param, bucket, start, end, offset, main))
        placements = Placements() if placements is None else placements  # a plain model's parameters: whole, decayed by shape
        inner = kinds.build([Stepped(x.main, x.param, x.flat_range[0]) for x in self.pieces], cfg, placements, layout)
        super().__init__(inner, cfg, tp_rank, norm_groups, scaler, placements)
        if grads.buckets:  # a rank owning no shard still needs its norm on the device NCCL reduces on
            self.device = grads.buckets[0].grad_data.device
        self._params_of_main = {x.main: x.param for x in self.pieces}

    def _param_of(self, tensor: torch.Tensor) -> nn.Parameter:
        return self._params_of_main[tensor]

    def _publish_params(self) -> None:
        for x in self.pieces:
            if x.main.data_ptr() != x.model_view.data_ptr():
                x.model_view.copy_(x.main)
        self.grads.all_gather_params()

    @property
    def state(self):
        raise AttributeError("DistributedOptimizer keeps its state per shard; use state_per_param() and "
                             "load_state_per_param() for the logical per-parameter state")

    def local_shards(self) -> list[LocalShard]:
        """This rank's pieces of the model weights and of the optimizer state, without any communication.

        One :class:`LocalShard` per (parameter, contiguous range of it this rank owns): ``param`` (map it
        to its logical name with ``named_parameters``), ``start``/``end`` in ``param.view(-1)`` coordinates,
        ``model`` (model dtype; under ZeRO-3 the persistent shard, never the gathered parameter), ``main``
        (fp32 master weights; the same tensor as ``model`` in fp32 training) and ``state`` (the
        :meth:`state_fields`, e.g. AdamW's ``exp_avg``/``exp_avg_sq``, empty before the first step; ``step``
        is :attr:`steps`). All are
        views of the live tensors: writing into them loads a checkpoint shard by shard (then call nothing
        else: the next gather or step reads them). Over a DP group the ranks' ranges of a parameter are
        disjoint and cover it (hybrid sharding: once per instance); with tensor parallelism ``param`` is
        this TP rank's slice, and the range is in its coordinates.
        """
        state = self.optimizer.state
        return [LocalShard(x.param, *x.flat_range, x.model_view, x.main,
                           {k: state[x.main][k] for k in self.state_fields(x.param) if x.main in state})
                for x in self.pieces]

    def _main_grads(self) -> tuple[list[torch.Tensor], list[bool]]:
        self.grads.keep_grad_shards()  # ZeRO-2/3: the full gradient buffers go (every sync is done)
        for x in self.pieces:  # fp32 grads: a view (no copy); 16-bit grads: an fp32 copy
            grad = x.grad_view
            x.main.grad = grad if grad.dtype == torch.float32 else grad.float()
        return [x.main.grad for x in self.pieces], self._counted(x.param for x in self.pieces)

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Main parameters := model parameters (after the checkpoint code loaded the model's weights)."""
        for x in self.pieces:
            x.main.copy_(x.model_view)

    @torch.no_grad()
    def state_per_param(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """{param: {state field (:meth:`state_fields`)..., "main_param" (fp32, param-shaped), "step"}} for
        every parameter of this rank, gathered over DP; empty before the first step. Collective over DP."""
        if self.steps == 0:
            return {}
        step = torch.tensor(float(self.steps), dtype=torch.float32)
        out: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        for bucket in self.grads.buckets:
            keys = dict.fromkeys(k for p in bucket.params for k in self.state_fields(p))  # the same on every rank
            full = {k: torch.zeros(bucket.grad_data.numel(), dtype=torch.float32, device=bucket.grad_data.device)
                    for k in (*keys, "main_param")}
            for x in self.pieces:
                if x.bucket is bucket:
                    full["main_param"][x.start:x.end] = x.main
                    state = self.optimizer.state.get(x.main)
                    for k in self.state_fields(x.param) if state else ():
                        full[k][x.start:x.end] = state[k].reshape(-1)
            if bucket.shards > 1:  # over its own group (a MoE model's expert buckets: expert-data-parallel)
                group = self.grads.group_of(bucket)
                handles = [all_gather_single(t, t[bucket.shard_start:bucket.shard_end].clone(),
                                             group=group, async_op=True) for t in full.values()]
                for handle in handles:
                    handle.wait()
            for param, offset in zip(bucket.params, bucket.offsets, strict=True):
                out[param] = {k: full[k][offset:offset + param.numel()].view_as(param)
                              for k in (*self.state_fields(param), "main_param")}
                out[param]["step"] = step.clone()
        return out

    @torch.no_grad()
    def load_state_per_param(self, states: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """Inverse of :meth:`state_per_param` (each rank keeps its shard; no communication). With a
        ``main_param`` entry the fp32 main weights (and this rank's piece of the model's) are restored too."""
        steps = {int(s["step"]) for s in states.values()}
        if len(steps) > 1:
            raise ValueError(f"load_state_per_param: parameters at different steps {sorted(steps)}")
        self.steps = steps.pop() if steps else self.steps
        for x in self.pieces:
            state = states.get(x.param)
            if state is None:
                continue
            kinds.install_state(self.optimizer, x.main, {k: x.of(state[k]) for k in self.state_fields(x.param)},
                                self.steps)
            if "main_param" in state:
                x.main.copy_(x.of(state["main_param"]))
                if x.main.data_ptr() != x.model_view.data_ptr():
                    x.model_view.copy_(x.main)
