"""Start local workers through ``torch.distributed.run`` (torchrun), so ``ptdp train --nproc-per-node 8``
works without typing torchrun, with its elastic restarts (``--max-restarts``)."""

from __future__ import annotations

import os
import signal
import sys

from .errors import print_error


def launch_workers(nproc_per_node: int, max_restarts: int, worker_args: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # One intra-op thread per worker unless the user chose: workers share the node's cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    launcher_args = get_args_parser().parse_args([
        "--standalone",  # rendezvous on a port the OS picks: concurrent jobs cannot collide
        f"--nproc-per-node={nproc_per_node}",
        f"--max-restarts={max_restarts}",
        "--module", "ptdp", *worker_args,
    ])
    try:
        run(launcher_args)
    except ChildFailedError as e:
        codes = sorted({f.exitcode for f in e.failures.values()})
        print_error("train", f"worker(s) failed with exit code {codes}; see their messages above")
        # Negative codes are signals, mostly the launcher's own SIGTERM to the workers still running when
        # the first one failed: the workers' own exit code (2: bad input on every rank) is the answer.
        exited = {code for code in codes if code > 0}
        return exited.pop() if len(exited) == 1 else 1
    except SignalException as e:  # e.g. a scheduler's pre-emption: the workers save on SIGTERM
        print(f"ptdp train: stopped by signal {e.sigval}; the workers saved a checkpoint if --save was set",
              file=sys.stderr)
        return 0 if e.sigval == signal.SIGTERM else 128 + int(e.sigval)
    return 0
