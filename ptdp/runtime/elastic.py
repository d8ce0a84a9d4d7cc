"""Elastic training: the world size may change between (re)starts, the model layout may not.

With ``--nnodes MIN:MAX`` (torchrun's elastic agent, c10d rendezvous) or ``--elastic`` (one node whose
``--nproc-per-node`` may change between relaunches), a start whose world size differs from the
checkpoint's keeps t, c and p, derives d = world size / (t·c·p), keeps ``--global-batch-size`` B by
running m = B / (b·d) microbatches, and loads the latest checkpoint resharded into the new layout
(``checkpointing/state.py``). Nothing else needs to change: the samples of global batch k are positions
``[k·B, (k+1)·B)`` whatever d is (``data/microbatch.py``), and the LR is a function of the iteration, so
the run continues from the next global batch with no sample skipped or seen twice.

A world size that cannot hold the layout is refused in one line naming the sizes that would work.
No torch import here: the launcher checks before any worker starts.
"""

from __future__ import annotations

from ptdp.config import Config, validate


def parse_nnodes(value: str | None) -> tuple[int, int]:
    """``--nnodes N`` or ``MIN:MAX`` (torchrun's form) as (min, max); ValueError with the flag named."""
    if value is None:
        return 1, 1
    low, _, high = value.partition(":")
    try:
        nodes = (int(low), int(high or low))
    except ValueError:
        raise ValueError(f"--nnodes must be N or MIN:MAX (torchrun's form), got {value!r}") from None
    if not 1 <= nodes[0] <= nodes[1]:
        raise ValueError(f"--nnodes {value} needs 1 <= MIN <= MAX")
    return nodes


def working_world_sizes(config: Config, local_world_size: int | None, limit: int = 8) -> list[int]:
    """The smallest ``limit`` world sizes this configuration runs on, with ``local_world_size`` workers
    per node (None: all on one node). d ranges over 1..B/b; each candidate goes through ``validate``."""
    par, tr = config.parallel, config.training
    unit = (par.tensor_model_parallel_size * par.context_parallel_size
            * par.pipeline_model_parallel_size)
    sizes = []
    for d in range(1, tr.global_batch_size // max(tr.micro_batch_size, 1) + 1):
        world = d * unit
        local = world if local_world_size is None else local_world_size
        if local_world_size is not None and world % local_world_size:
            continue  # not a whole number of nodes
        if not validate(config, world, local):
            sizes.append(world)
            if len(sizes) == limit:
                break
    return sizes


def world_size_error(config: Config, world_size: int, local_world_size: int | None,
                     nodes: bool) -> str | None:
    """One line when ``world_size`` cannot run ``config`` but other world sizes can (None otherwise: the
    problem is not the world size, and ``validate``'s own lines say what it is). ``nodes``: say it in
    ``--nnodes`` values of ``local_world_size`` workers each, else in ``--nproc-per-node`` values."""
    errors = validate(config, world_size, local_world_size)
    if not errors:
        return None
    sizes = working_world_sizes(config, local_world_size if nodes else None)
    if not sizes:
        return None
    if nodes:
        works = (f"--nnodes {', '.join(str(w // local_world_size) for w in sizes)} with --nproc-per-node "
                 f"{local_world_size} (world sizes {', '.join(map(str, sizes))})")
    else:
        works = f"--nproc-per-node {', '.join(map(str, sizes))}"
    return f"world size {world_size} cannot run this job ({errors[0]}); these would: {works}"


def layout_change(saved: dict, now: dict, global_batch_size: int, num_microbatches: int) -> str | None:
    """The line a resumed run prints when the checkpoint was written by another layout (None if not)."""
    if saved == now:
        return None
    def short(layout: dict) -> str:
        return (f"t={layout.get('tensor_model_parallel_size')} p={layout.get('pipeline_model_parallel_size')} "
                f"d={layout.get('data_parallel_size')}")
    return (f" resharded the checkpoint from {short(saved)} to {short(now)}; global batch {global_batch_size} "
            f"kept with {num_microbatches} microbatches per iteration")
