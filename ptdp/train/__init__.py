"""Training: ``state`` (the typed :class:`TrainState` and ``setup``), ``step`` (one iteration), ``loop``
(iterations, logging, evaluation, checkpoints), ``report`` (records and lines), ``evaluate`` (validation).

Imported by the CLI only; nothing below imports it (import-linter's layers contract).
"""
