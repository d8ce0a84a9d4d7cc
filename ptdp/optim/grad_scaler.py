"""Loss scaling for fp16 training (Megatron's ``ConstantGradScaler`` / ``DynamicGradScaler``).

fp16 has 5 exponent bits: small gradients underflow to zero unless the loss is multiplied by a large
scale before the backward (and the gradients divided by it afterwards, in fp32). Too large a scale
overflows to inf instead; the dynamic scaler then skips the step and halves the scale (after
``hysteresis`` overflows), and doubles it again after ``window`` clean steps. bf16 has fp32's exponent
range and needs no scaling.
"""

from __future__ import annotations


class ConstantGradScaler:
    """``--loss-scale S``: always S, overflowing steps are still skipped."""

    def __init__(self, scale: float):
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        """Checkpoints record the scale (a ``--save`` with ``--loss-scale`` needs this to save at all)."""
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: the scale is the flag's, whatever the checkpoint holds."""


class DynamicGradScaler:
    """Megatron's dynamic scaler: back off x0.5 on overflow (after ``hysteresis`` of them), grow x2 after
    ``window`` consecutive clean steps, never below ``min_scale``."""

    def __init__(self, initial_scale: float, min_scale: float, window: int, hysteresis: int,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5):
        self.scale = float(initial_scale)
        self.min_scale, self.window, self.hysteresis = float(min_scale), window, hysteresis
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.window:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])
