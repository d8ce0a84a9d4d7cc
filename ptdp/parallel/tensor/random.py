"""Named RNG streams, so dropout is right under tensor parallelism.

Dropout on activations that every TP rank holds in full (embeddings, residual stream) must draw the
same mask on every TP rank, or the replicas diverge; dropout on activations that are *split* across TP
ranks (attention probabilities of each rank's own heads) must draw different masks, or the model would
see correlated masks that one process never would. Megatron solves this with a tracker of named RNG
states: the default generator is seeded identically on all TP ranks, and the ``model-parallel`` stream
is seeded with an offset by TP rank and entered with :meth:`RNGStatesTracker.fork` around dropout inside
tensor-parallel regions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
_MODEL_PARALLEL_SEED_OFFSET = 2718  # Megatron's offset, so the stream differs from the default one


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Holds named generator states and swaps them in for the duration of a ``with fork(name):``."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        """A new stream seeded with ``seed``, drawn from a private generator of this tracker's device type.

        ``torch.manual_seed`` would reseed every generator of the process (the CPU one and each GPU's),
        not only the one this tracker swaps; a fresh ``torch.Generator`` gives the same state bytes and
        touches nothing else.
        """
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        self.states[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        saved = _get_state(self.device)
        _set_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(saved, self.device)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def model_parallel_seed(seed: int, tp_rank: int, pp_rank: int, device: torch.device) -> None:
    """Seed the default stream (same on all TP ranks of a stage) and the per-TP-rank stream.

    Stages get different default seeds (as in Megatron) so that their dropout masks are independent.
    """
    global _TRACKER
    default_seed = seed + 100 * pp_rank
    torch.manual_seed(default_seed)
    _TRACKER = RNGStatesTracker(device)
    _TRACKER.add(MODEL_PARALLEL_RNG, default_seed + _MODEL_PARALLEL_SEED_OFFSET + tp_rank)
