"""Checkpoints that reshard: save in one (t, p, d, v) layout, load in any other (docs/checkpoints.md).

- ``storage``: the on-disk layout, atomic commits, ``latest``, sha256 checksums, pruning (no torch)
- ``validation``: start-up checks of --save/--load and of the checkpoint itself (no torch)
- ``state``: the logical state dict and its trip through ``torch.distributed.checkpoint``
- ``interface``: :class:`Checkpointable`, what a save reads and a load restores (not the trainer)
- ``manager``: the training loop's checkpoints (resume, interval/exit/final saves, async)
- ``full_model``: full tensors in one process, no process group (generate, Hugging Face import/export)
- ``hf_dir`` / ``hf_reader``: ``--load HF_DIR``, a Hugging Face directory checked from its headers (no torch)
  and read through DCP as an imported checkpoint, each rank only its slices
"""

import importlib

# Each name loads its module on first use: ``storage`` and ``validation`` (no torch) serve the command
# line's checks and ``ptdp samples`` without importing torch.
_MODULE_OF = {
    "read_full_model_state": "full_model", "write_full_model_state": "full_model", "CheckpointManager": "manager",
    "Checkpointable": "interface", "DataPosition": "interface", "load_checkpoint": "state",
    "save_checkpoint": "state", "CheckpointError": "storage", "read_latest": "storage",
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
