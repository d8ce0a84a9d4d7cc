"""Gradients and the optimizer step: data-parallel reduction, global-norm clipping, AdamW, LR schedule.

Gradients live in contiguous per-bucket buffers (``param.grad`` is a view into its bucket), so the
data-parallel reduction is one all-reduce per bucket rather than one per parameter, and autograd
accumulates microbatch gradients in place straight into the buffers (gradient accumulation is free).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from .config import OptimizerConfig
from .tensor_parallel.mappings import group_size


class GradBuckets:
    """Flat gradient buffers for ``params``, all-reduced (averaged) over the data-parallel group."""

    def __init__(self, params: list[nn.Parameter], dp_group, bucket_bytes: int):
        self.params = [p for p in params if p.requires_grad]
        self.dp_group = dp_group
        self.buffers: list[torch.Tensor] = []
        # Megatron fills buckets in reverse order, so that the last layers' grads (ready first) go first.
        bucket: list[nn.Parameter] = []
        for p in reversed(self.params):
            bucket.append(p)
            if sum(q.numel() * q.element_size() for q in bucket) >= bucket_bytes:
                self._make_bucket(bucket)
                bucket = []
        if bucket:
            self._make_bucket(bucket)

    def _make_bucket(self, params: list[nn.Parameter]) -> None:
        buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for p in params:
            p.grad = buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.buffers.append(buffer)

    def zero(self) -> None:
        for buffer in self.buffers:
            buffer.zero_()

    def all_reduce(self) -> None:
        """Average gradients over data-parallel replicas (loss is a mean, so the grads must be too)."""
        world = group_size(self.dp_group)
        if world == 1:
            return
        handles = [dist.all_reduce(b.div_(world), group=self.dp_group, async_op=True) for b in self.buffers]
        for handle in handles:
            handle.wait()


def counts_in_grad_norm(param: nn.Parameter, tp_rank: int) -> bool:
    """Whether this rank's copy of ``param`` is counted in the global norm (each element exactly once).

    Replicated across TP (LayerNorm, row-parallel biases): only TP rank 0 counts it. The last stage's
    copy of the tied embedding is never counted: the first stage's is.
    """
    if getattr(param, "is_embedding_copy", False):
        return False
    return getattr(param, "tensor_model_parallel", False) or tp_rank == 0


@torch.no_grad()
def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float, tp_rank: int, model_parallel_groups) -> float:
    """Global L2 norm of the gradients across TP and PP (DP replicas hold equal, averaged grads)."""
    params = list(params)
    counted = [p.grad for p in params if p.grad is not None and counts_in_grad_norm(p, tp_rank)]
    device = params[0].device
    total = torch.zeros((), dtype=torch.float32, device=device)
    if counted:
        total = torch.stack([g.float().pow(2).sum() for g in counted]).sum()
    for group in model_parallel_groups:
        if group_size(group) > 1:
            dist.all_reduce(total, group=group)
    norm = total.sqrt().item()
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


def build_optimizer(params: list[nn.Parameter], cfg: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not biases, not LayerNorm), as Megatron does."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)


def learning_rate(iteration: int, cfg: OptimizerConfig, train_iters: int) -> float:
    """Megatron's schedule at 1-based ``iteration``: linear warm-up, then cosine/linear decay to min-lr."""
    warmup = cfg.lr_warmup_iters
    if warmup > 0 and iteration <= warmup:
        return cfg.lr * iteration / warmup
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    decay_iters = cfg.lr_decay_iters or train_iters
    if iteration > decay_iters:
        return cfg.min_lr
    ratio = (iteration - warmup) / max(1, decay_iters - warmup)
    if cfg.lr_decay_style == "linear":
        coeff = 1.0 - ratio
    else:
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)
