"""Issue 26 on the CPU: what keeps the steady-state loop off the GPU's queue and the watchdog quiet.

The GPU tier (tests/test_gpu.py, ``pytest -m gpu``) counts real synchronisations with
``torch.cuda.set_sync_debug_mode("error")``; these tests check the same design where a CPU can: the
per-iteration agreement (SIGTERM, NaN) never makes a tensor on the model's device, and the hang watchdog is
armed only after the first iteration (which holds the lazy ``torch.compile``).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from helpers import spawn

from ptdp.checkpointing import CheckpointManager


def _trainer(rank: int, world_size: int, device: str, mesh, run_dir: str, hang_timeout_s: float = 300.0):
    config = SimpleNamespace(
        checkpoint=SimpleNamespace(save=None, load=None, async_save=False, exit_interval=None, save_interval=None),
        parallel=SimpleNamespace(hang_timeout_s=hang_timeout_s),
        training=SimpleNamespace(metrics_file=f"{run_dir}/metrics.jsonl"))
    state = SimpleNamespace(rank=rank, mesh=mesh, device=torch.device(device),
                            dims=SimpleNamespace(world_size=world_size))
    return SimpleNamespace(config=config, state=state)


def _agree_on_a_meta_device(rank: int, world_size: int, run_dir: str) -> None:
    # A "meta" model device: any agreement tensor made there could not be all-reduced (nor read), so this
    # passes only if the agreement stays on the host, over a gloo group of its own.
    manager = CheckpointManager(_trainer(rank, world_size, "meta", object(), run_dir))
    try:
        assert manager._agree_group is not None
        assert manager._agree(rank == 1, False) == [True, False]
        assert manager._agree(False, rank == 0) == [False, True]
        assert manager.after_iteration(1, None) is False  # nothing signalled, loss not read: go on
        manager._signalled = rank == 0
        assert manager.after_iteration(2, None) is True  # rank 0's SIGTERM stops every rank together
    finally:
        manager.close()


def test_agreement_never_touches_the_model_device(tmp_path):
    spawn(_agree_on_a_meta_device, 2, tmp_path, str(tmp_path))


def test_watchdog_is_armed_after_the_first_iteration(tmp_path):
    """The first iteration (lazy compile, NCCL communicators) is not watched; from the second on it is."""
    manager = CheckpointManager(_trainer(0, 2, "cpu", None, str(tmp_path)))
    try:
        manager.before_iteration(5)  # a resumed run: its first iteration is 5
        assert manager.watchdog is None
        manager.before_iteration(6)
        assert manager.watchdog is not None and (tmp_path / "hang").is_dir()
    finally:
        manager.close()
