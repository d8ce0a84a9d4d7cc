"""One worker of ``ptdp train`` (a rank under a launcher, or the one process): train, and leave with one line and the right exit code whatever happened.

The configuration was checked before (``ptdp.cli.main.run_train``); what can still go wrong here is said by
the rank that knows (rank 0 for problems every rank finds alike) as one line, and the process groups are
torn down so that gloo does not abort at exit.
"""

from __future__ import annotations

import os
from datetime import timedelta

from ptdp.config import Config, ConfigError
from ptdp.runtime import allocator, collector, interrupt
from ptdp.runtime.errors import print_error


def run_worker(config: Config) -> int:
    """Train ``config`` on this rank; 0, 130 after a Ctrl-C stop (0 under ptdp's launcher, which reports
    the 130), 2 for a problem of the inputs found only now."""
    from ptdp.data import DataError

    interrupt.install(int(os.environ.get("RANK", "0")), config.checkpoint.save)  # Ctrl-C: a graceful stop
    try:
        from ptdp.runtime.phases import phase

        with phase("importing torch and the training code"):
            from ptdp.train.loop import train
        collector.resume()  # paused by ptdp.cli.main.main in a process of its own
        import torch

        # One CPU process of its own: iterations without page faults (ptdp/runtime/allocator.py). The launcher's
        # workers (torchrun's restart count set) follow --cpu-mmap-threshold, 0 included.
        if not torch.cuda.is_available() and "TORCHELASTIC_RESTART_COUNT" not in os.environ:
            allocator.keep_freed_memory()
        train(config)
        code = interrupt.exit_code() or 0
    except (ConfigError, DataError) as e:  # raised alike on every rank: the groups are still healthy
        if int(os.environ.get("RANK", "0")) == 0:
            print_error("train", e)
        code = 2
    except Exception as e:  # a peer that left at once after a second Ctrl-C: leave quietly too
        if not interrupt.interrupted_exception(e):
            raise
        interrupt.stop_now()
    _teardown(code)
    return code


def _teardown(code: int) -> None:
    """gloo aborts the process at exit ("terminate called without an active exception") when its process
    groups are left for the interpreter to tear down. Not after other errors: a lost peer can make the
    teardown wait, and the launcher restarts or stops the job anyway."""
    import torch.distributed as dist

    from ptdp.observability import communication

    if not dist.is_initialized():
        return
    if code and dist.get_backend() == "gloo":  # every rank raised: let all finish talking before teardown
        try:
            communication.monitored_barrier(timeout=timedelta(seconds=60), action="teardown")
        except RuntimeError:
            pass
    dist.destroy_process_group()
