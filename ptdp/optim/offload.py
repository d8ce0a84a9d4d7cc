"""``--optimizer-cpu-offload`` (Megatron-LM's flag; ZeRO-Offload): the optimizer's state and step on the host.

The GPU keeps what the forward and backward need (the model's parameters and gradient buffers, and the
fp32 main parameters of a 16-bit model); the two fp32 Adam moments -- 8 bytes per parameter, the largest
item of mixed-precision training's 18 (docs/references.md, §Memory) -- live in host memory, and AdamW runs on
the CPU (SGD's momentum likewise: :class:`HostOffload` wraps any element-wise torch optimizer; Muon keeps its
momentum on the host itself and orthogonalises on the device, ``ptdp.optim.muon``). Each step:

1. the (already reduced, unscaled and clipped) fp32 gradients and the fp32 parameters being stepped are
   copied device -> host into pinned buffers, all enqueued with ``non_blocking=True``, then one wait for
   the copies (the only host synchronisation, inherent to stepping on the host);
2. ``torch.optim.AdamW``'s fused CPU kernel (its single-tensor implementation on a torch without one) steps
   the host copies, so the arithmetic is torch's CPU AdamW to the bit (exact against the on-device optimizer
   on a CPU; on a GPU against the fused CUDA kernel up to its rounding);
3. the new parameters are copied host -> device with ``non_blocking=True`` on the compute stream: the
   next iteration's kernels queue behind them while the host already runs ahead (the copy back overlaps
   the host's work of the next iteration; the copy out does not yet overlap the backward).

The parameters are copied out every step rather than kept as a host master copy, so nothing can go stale
when a checkpoint (or ``reload_model_params``) rewrites the device's copy. Checkpoints see the usual
``state[param]`` of torch's AdamW, keyed by the device parameter, holding host tensors; a state loaded onto
the device moves to the host at the next step.
"""

from __future__ import annotations

import functools

import torch

from ptdp.optim.eager import AdamW, Eager


@functools.cache
def fused_adamw_on(device_type: str) -> bool:
    """Whether this torch has a fused AdamW kernel for ``device_type`` (asked of torch itself: its
    constructor refuses a device it has none for)."""
    try:
        AdamW([torch.zeros(1, device=device_type, requires_grad=True)], fused=True)
    except (RuntimeError, ValueError):
        return False
    return True


class HostOffload(Eager, torch.optim.Optimizer):
    """An element-wise torch optimizer (the next class in the MRO) over device parameters whose state and
    arithmetic live on the host."""

    host_implementation = {"foreach": False}  # torch's single-tensor path, unless a subclass has a fused one

    def __init__(self, params, **kwargs):
        kwargs.pop("fused", None)  # the step runs on the CPU
        super().__init__(params, **self.host_implementation, **kwargs)
        self._pin = torch.cuda.is_available()
        self._host: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}

    def _buffers(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pinned host (parameter, gradient) pair of device parameter ``p``, allocated once."""
        if p not in self._host:  # on a CPU model too (separate buffers): the same code path as on a GPU
            pin = self._pin and p.device.type == "cuda"
            self._host[p] = tuple(torch.empty(p.shape, dtype=p.dtype, pin_memory=pin) for _ in range(2))
        return self._host[p]

    @staticmethod
    def _to_host(state: dict) -> None:
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                state[key] = value.to("cpu")

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError(f"{type(self).__name__}.step takes no closure")
        device_groups, copies, waits = [], [], []
        for group in self.param_groups:
            device_groups.append(group["params"])
            hosts = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                host, grad = self._buffers(p)
                host.copy_(p.detach(), non_blocking=True)
                grad.copy_(p.grad, non_blocking=True)
                host.grad = grad
                hosts.append(host)
                copies.append((p, host))
                if p.device.type == "cuda":
                    waits.append(p.device)
            group["params"] = hosts
        for device in set(waits):  # the one wait: every device-to-host copy of this step has landed
            torch.cuda.current_stream(device).synchronize()
        for device_param, host in copies:  # the state is keyed by the device parameter; AdamW's by the host one
            if device_param in self.state:
                state = self.state.pop(device_param)
                self._to_host(state)
                self.state[host] = state
        try:
            super().step()
        finally:
            for group, params in zip(self.param_groups, device_groups, strict=True):
                group["params"] = params
            for device_param, host in copies:
                if host in self.state:
                    self.state[device_param] = self.state.pop(host)
        for device_param, host in copies:  # queued on the compute stream: the host does not wait for them
            device_param.copy_(host, non_blocking=True)
        return None


class HostOffloadAdamW(HostOffload, torch.optim.AdamW):
    """torch's AdamW, state and step on the host: its fused CPU kernel where torch has one (as DeepSpeed's
    CPU Adam), the arithmetic of the on-device AdamW of a CPU run to the bit."""

    @property
    def host_implementation(self) -> dict:
        return {"fused": True} if fused_adamw_on("cpu") else {"foreach": False}


class HostOffloadSGD(HostOffload, torch.optim.SGD):
    """torch's SGD (momentum buffers) on the host."""
