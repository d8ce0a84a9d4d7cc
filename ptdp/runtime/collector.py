"""The garbage collector paused while a ptdp process imports its code.

Importing torch and ptdp's training path makes a few hundred thousand objects, nearly all alive for the whole
run (modules, classes, functions), and the collector's passes over them during the imports -- three full
collections among hundreds of young ones -- are about 15% of the CPU a start costs (0.2-0.3 s of a
launcher's or a worker's; BENCHMARKS.md, "Process start-up"). A process of its own (``ptdp ...``, not a call
of ``ptdp.cli.main.main`` from Python) calls :func:`pause` first and :func:`resume` once its imports are
done: the objects made so far are frozen (``gc.freeze``: left out of every later collection, so the run's
own full collections scan less too) and collection resumes. Nothing else changes: the imports make little
cyclic garbage, and what they make is kept as the frozen objects are.
"""

from __future__ import annotations

import gc

_paused = False


def pause() -> None:
    """Stop automatic collection (where it runs) until :func:`resume`."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume() -> None:
    """Freeze what exists and collect again, after a :func:`pause` (otherwise nothing)."""
    global _paused
    if _paused:
        gc.freeze()
        gc.enable()
        _paused = False
