"""Start local workers through ``torch.distributed.run`` (torchrun), so ``ptdp train --nproc-per-node 8``
works without typing torchrun, with its elastic restarts (``--max-restarts``)."""

from __future__ import annotations

import os
import signal
import sys

from ptdp.runtime.errors import print_error


def launcher_flags(nproc_per_node: int, max_restarts: int, rendezvous: dict[str, str] | None = None) -> list[str]:
    """torchrun's own flags. ``rendezvous`` (``nnodes``, ``rdzv_endpoint``, ``rdzv_id``, ``rdzv_conf``,
    ``monitor_interval``) makes this agent one of several meeting through a c10d rendezvous: with
    ``--nnodes MIN:MAX`` torchrun's elastic agent restarts the workers whenever a node is lost (a failure,
    which counts against ``--max-restarts``) or one joins (which does not), and ptdp derives d from the new
    world size (docs/multinode.md, §Elastic training). Without it, ``--standalone``: a rendezvous on a port
    the OS picks, so concurrent jobs cannot collide."""
    # SIGINT is not torchrun's: ptdp.runtime.interrupt passes Ctrl-C on to the workers as a graceful stop.
    flags = [f"--nproc-per-node={nproc_per_node}", f"--max-restarts={max_restarts}",
             "--signals-to-handle=SIGTERM,SIGHUP,SIGQUIT"]
    if not rendezvous:
        return ["--standalone", *flags]
    flags += [f"--nnodes={rendezvous['nnodes']}", "--rdzv-backend=c10d",
              f"--rdzv-endpoint={rendezvous['rdzv_endpoint']}", f"--rdzv-id={rendezvous.get('rdzv_id') or 'ptdp'}"]
    for key in ("rdzv_conf", "monitor_interval"):
        if rendezvous.get(key):
            flags.append(f"--{key.replace('_', '-')}={rendezvous[key]}")
    return flags


def launch_line(nproc_per_node: int, world_size: int, tensor: int, context: int, pipeline: int) -> str:
    """The launcher's first line, printed before anything slow (importing torch to check the
    configuration, the rendezvous, every worker's start-up): what starts, in which layout."""
    model = tensor * context * pipeline
    data = str(world_size // model) if model > 0 and world_size % model == 0 else "?"
    where = f" on this node (world size {world_size})" if world_size != nproc_per_node else ""
    return (f"ptdp train: {nproc_per_node} worker(s){where}, layout t={tensor} "
            f"{f'c={context} ' if context > 1 else ''}p={pipeline} d={data}: checking the configuration, then "
            "starting them; rank 0 reports each start-up step that takes more than 2 s")


def launch_workers(nproc_per_node: int, max_restarts: int, worker_args: list[str],
                   rendezvous: dict[str, str] | None = None, cpu_mmap_threshold: int = 0) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # One intra-op thread per worker unless the user chose: workers share the node's cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    if cpu_mmap_threshold and not torch.cuda.is_available():  # freed activations leave the RSS (BENCHMARKS.md)
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(cpu_mmap_threshold))
    if rendezvous:
        # Scale-up needs the rendezvous's own bootstrap keys. With torchrun's shared TCP store (the default
        # since 2.4) an agent that stays rank 0 across rounds publishes MASTER_ADDR only in its first round,
        # so a node joining a running job waits for it forever while rank 0 waits for the newcomer's role
        # info (torch 2.13: both time out after 60 s). Unshared, rank 0 publishes it every round.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    launcher_args = get_args_parser().parse_args([
        *launcher_flags(nproc_per_node, max_restarts, rendezvous), "--module", "ptdp", *worker_args])
    from ptdp.runtime import interrupt

    interrupt.install_launcher()  # Ctrl-C goes to the workers as a graceful stop (ptdp/runtime/interrupt.py)
    try:
        run(launcher_args)
    except ChildFailedError as e:
        codes = sorted({f.exitcode for f in e.failures.values()})
        print_error("train", f"worker(s) failed with exit code {codes}; see their messages above")
        # Negative codes are signals, mostly the launcher's own SIGTERM to the workers still running when
        # the first one failed: the workers' own exit code (2: bad input on every rank) is the answer.
        exited = {code for code in codes if code > 0}
        return exited.pop() if len(exited) == 1 else 1
    except SignalException as e:  # e.g. a scheduler's pre-emption: the workers were passed the signal
        name = signal.Signals(e.sigval).name
        print(f"ptdp train: stopped by {name}, which was passed on to the workers", file=sys.stderr)
        return 0 if e.sigval == signal.SIGTERM else 128 + int(e.sigval)
    # After Ctrl-C the workers stopped (rank 0 said how) and exited 0, so torchrun did not restart them.
    return interrupt.EXIT_CODE if interrupt.launcher_interrupted() else 0
