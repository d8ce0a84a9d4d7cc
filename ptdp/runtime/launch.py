"""Start local workers through ``torch.distributed.run`` (torchrun), so ``ptdp train --nproc-per-node 8``
works without typing torchrun, with its elastic restarts (``--max-restarts``)."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

from ptdp.runtime.errors import print_error
from ptdp.runtime.launcher_stop import TORCHRUN_LOGGERS


def launcher_flags(nproc_per_node: int, max_restarts: int, rendezvous: dict[str, str] | None = None) -> list[str]:
    """torchrun's own flags. ``rendezvous`` (``nnodes``, ``rdzv_endpoint``, ``rdzv_id``, ``rdzv_conf``,
    ``monitor_interval``) makes this agent one of several meeting through a c10d rendezvous: with
    ``--nnodes MIN:MAX`` torchrun's elastic agent restarts the workers whenever a node is lost (a failure,
    which counts against ``--max-restarts``) or one joins (which does not), and ptdp derives d from the new
    world size (docs/multinode.md, §Elastic training). Without it, ``--standalone``: a rendezvous on a port
    the OS picks, so concurrent jobs cannot collide."""
    # SIGINT is not torchrun's: ptdp.runtime.launcher_stop passes Ctrl-C on to the workers as a graceful stop.
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


def launch_line(nproc_per_node: int | None, world_size: int, tensor: int, context: int, pipeline: int) -> str:
    """The first line of ``ptdp train``, printed before anything slow (importing torch to check the
    configuration, the rendezvous, every worker's start-up): what starts, in which layout.
    ``nproc_per_node`` None: one process, no launcher."""
    model = tensor * context * pipeline
    data = str(world_size // model) if model > 0 and world_size % model == 0 else "?"
    layout = f"layout t={tensor} {f'c={context} ' if context > 1 else ''}p={pipeline} d={data}"
    if nproc_per_node is None:
        return (f"ptdp train: one process, {layout}: checking the configuration, then starting; each start-up "
                "step that takes more than 2 s is reported")
    where = f" on this node (world size {world_size})" if world_size != nproc_per_node else ""
    return (f"ptdp train: {nproc_per_node} worker(s){where}, {layout}: checking the configuration, then "
            "starting them; rank 0 reports each start-up step that takes more than 2 s")


def launch_workers(nproc_per_node: int, max_restarts: int, worker_args: list[str],
                   rendezvous: dict[str, str] | None = None, save: str | None = None,
                   cpu_mmap_threshold: int = 0, run_dir: Path | None = None) -> int:
    """Run torchrun's agent in this process; the exit code of the job. What reaches the terminal is the
    workers' own lines and at most one of the launcher's per event (:class:`_WorkerFailures`): torchrun's
    log lines (``Sending process ... closing signal SIGTERM``, ``failed (exitcode: 2)``) are not printed.
    ``run_dir``: the workers' run directory, where a hang report tells a worker the reporter killed (a
    stopped rank on this host) from one that died unexplained."""
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
    from ptdp.runtime import launcher_stop

    launcher_stop.install_launcher(save)  # Ctrl-C goes to the workers as a graceful stop
    failures = _WorkerFailures(max_restarts, single_node=not rendezvous, hang_dir=run_dir and run_dir / "hang")
    failures.attach()
    try:
        run(launcher_args)
    except ChildFailedError as e:
        if launcher_stop.launcher_interrupted():  # workers killed by the stop in progress: it reports
            launcher_stop.finish_launcher_stop()
        codes = sorted({f.exitcode for f in e.failures.values()})
        # Negative codes are signals, mostly the launcher's own SIGTERM to the workers still running when
        # the first one failed: the workers' own exit code (2: bad input on every rank) is the answer.
        exited = {code for code in codes if code > 0}
        if not exited & _REPORTED_BY_WORKERS:  # a worker that said nothing: a crash, a kill
            print_error("train", f"worker(s) failed ({failures.describe(codes)}); see their messages above")
        return exited.pop() if len(exited) == 1 else 1
    except SignalException as e:  # e.g. a scheduler's pre-emption: the workers were passed the signal
        name = signal.Signals(e.sigval).name
        print(f"ptdp train: stopped by {name}, which was passed on to the workers", file=sys.stderr)
        return 0 if e.sigval == signal.SIGTERM else 128 + int(e.sigval)
    finally:
        failures.detach()
        if not launcher_stop.launcher_interrupted():  # a stop in progress reads its status file, then removes it
            launcher_stop.close_launcher()
    # After Ctrl-C the workers stopped (rank 0 left the line) and exited 0, so torchrun did not restart them.
    launcher_stop.finish_launcher_stop()
    return 0


# Exit codes whose worker printed its own one-line error (2: bad input; 3: a hang report, naming the rank).
_REPORTED_BY_WORKERS = {2, 3}


def exit_description(code: int) -> str:
    """``exit code 1`` or ``killed by SIGKILL`` (torchrun reports a signal as a negative code)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _WorkerFailures(logging.Handler):
    """Replaces torchrun's log lines on the terminal: they are dropped, except that a worker's failure the
    agent answers with a restart (``--max-restarts``) gets one line of ours, unless the worker explained
    itself (exit 2 or 3). A worker killed by a signal after a new hang report appeared was killed by the
    reporter (a stopped rank, ``ptdp/observability/watchdog.py``): that report is its line, and which of the
    two exits torchrun sees first is a race."""

    def __init__(self, max_restarts: int, single_node: bool, hang_dir: Path | None = None) -> None:
        super().__init__(logging.INFO)
        self.left, self.total, self.single_node = max_restarts, max_restarts, single_node
        self._saved: list[tuple[logging.Logger, int, bool]] = []
        self.hang_dir = hang_dir
        self._reports = self._hang_reports()  # an earlier job's, which its workers remove at start

    def _hang_reports(self) -> set[tuple[str, int]]:
        if self.hang_dir is None:
            return set()
        try:
            return {(p.name, p.stat().st_mtime_ns) for p in self.hang_dir.glob("report-attempt*.txt")}
        except OSError:  # a report removed while listed
            return set()

    def _new_hang_report(self) -> bool:
        reports = self._hang_reports()
        new, self._reports = bool(reports - self._reports), self._reports | reports
        return new

    def attach(self) -> None:
        for name in TORCHRUN_LOGGERS:
            logger = logging.getLogger(name)
            self._saved.append((logger, logger.level, logger.propagate))
            logger.addHandler(self)
            logger.propagate = False

    def detach(self) -> None:
        for logger, level, propagate in self._saved:
            logger.removeHandler(self)
            logger.setLevel(level)
            logger.propagate = propagate
        self._saved.clear()

    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith("failed (exitcode") or not record.args or self.left <= 0:
            return
        code, local_rank = int(record.args[0]), record.args[1]  # torchrun logs the first failure of each round
        self.left -= 1
        reported = self._new_hang_report()
        if code in _REPORTED_BY_WORKERS or (code < 0 and reported):
            return
        who = f"worker rank {local_rank}" if self.single_node else f"local worker {local_rank}"
        group = os.environ.get("PTDP_REPLICA_GROUP")  # --fault-tolerant-replicas (ptdp/runtime/replicas.py)
        how = (f"restarting replica group {group}, which rejoins from a live peer" if group is not None
               else "restarting every worker from the latest checkpoint")
        sys.stderr.write(f"ptdp train: {who} {exit_description(code)}; {how} "
                         f"(restart {self.total - self.left} of {self.total})\n")
        sys.stderr.flush()

    @staticmethod
    def describe(codes: list[int]) -> str:
        return ", ".join(exit_description(code) for code in codes)
