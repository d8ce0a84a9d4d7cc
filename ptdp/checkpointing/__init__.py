"""Checkpoints that reshard: save in one (t, p, d, v) layout, load in any other (docs/checkpoints.md).

- ``storage``: the on-disk layout, atomic commits, ``latest``, sha256 checksums, pruning (no torch)
- ``validation``: start-up checks of --save/--load and of the checkpoint itself (no torch)
- ``state``: the logical state dict and its trip through ``torch.distributed.checkpoint``
- ``interface``: :class:`Checkpointable`, what a save reads and a load restores (not the trainer)
- ``manager``: the training loop's checkpoints (resume, interval/exit/final saves, async)
- ``full_model``: full tensors in one process, no process group (generate, Hugging Face import/export)
"""

from ptdp.checkpointing.full_model import read_full_model_state, write_full_model_state
from ptdp.checkpointing.interface import Checkpointable, DataPosition
from ptdp.checkpointing.manager import CheckpointManager
from ptdp.checkpointing.state import load_checkpoint, save_checkpoint
from ptdp.checkpointing.storage import CheckpointError, read_latest

__all__ = ["CheckpointError", "CheckpointManager", "Checkpointable", "DataPosition", "load_checkpoint",
           "read_full_model_state", "read_latest", "save_checkpoint", "write_full_model_state"]
