"""The loop each rank of the test session's pool runs (``helpers._RankPool``).

A module of its own that imports nothing heavy: a rank the pool spawns imports it first, so the garbage
collector is paused before the rank imports torch and ptdp, and what those imports made is frozen before
collection resumes -- as ``ptdp.runtime.collector`` does for ptdp's own processes, and for the same reason:
the collector's full passes over those objects are ~0.3 s of a start otherwise, and the pool starts its ranks
again each time a test changes the environment.
"""

from __future__ import annotations

import signal
import traceback

from ptdp.runtime import collector


def serve(rank: int, inbox, outbox) -> None:
    """Run each job ``inbox`` hands this rank (``helpers._entry``); put ``(rank, None | traceback)`` on
    ``outbox`` after each."""
    collector.pause()
    try:  # die with the test session, even one killed without its clean-up (CI's timeout): Linux's prctl
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    import helpers

    import ptdp.cli.main  # noqa: F401 -- what every layout's training imports (helpers._run_layouts)
    import ptdp.train.loop  # noqa: F401

    collector.resume()
    while True:
        fn, world_size, store, args = inbox.get()
        try:
            helpers._entry(rank, fn, world_size, store, args)
            outbox.put((rank, None))
        except BaseException:  # noqa: BLE001 -- reported to the test, which fails and kills the pool
            outbox.put((rank, traceback.format_exc()))
