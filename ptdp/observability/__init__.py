"""What a run shows while and after it trains, all optional and rank-0 unless said otherwise:

- ``tensorboard``: ``--tensorboard-dir``: the per-iteration record as TensorBoard scalars (rank 0)
- ``timeline``: ``--timeline DIR``: one Chrome trace per rank of the first iterations, and their merge
- ``summary``: the end-of-run summary line (tokens, wall time, TFLOP/s per GPU, best val loss, checkpoint)
- ``flight_recorder``, ``liveness``, ``watchdog``: every rank's progress (layers, executor actions, GPU
  work, communication) and the hang watchdog that reads it (``--hang-timeout-s``, every rank)

The flags are checked in two steps: ``--timeline-iters`` with the configuration (``ptdp.config.validate``,
pure), the directories and the tensorboard package at start-up (``ptdp.runtime.startup``), which may create
them.
"""
