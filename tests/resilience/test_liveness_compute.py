"""A rank inside one long compute operation is live work, never a hang.

On a loaded CPU one operation of a big layer (a weight-gradient matmul) can take minutes, during which the
rank ticks nothing. Its watchdog says so in its heartbeat: the main thread is inside a native call (the
interpreter lock is free), outside communication, and the process's CPU time advances; :func:`diagnose`
then waits. What stays a hang: a stopped process (its heartbeat goes stale), a rank blocked in a collective,
a rank whose CPU time stands still, and a rank looping in Python (it holds the interpreter lock).

The decision on heartbeats, the measurement on this process's own main thread (real threads, a few
seconds), the watchdog's heartbeat around a long operation in this process, and one real 2-stage run whose
stage 0 computes for 4x the timeout at once without a tick.
"""

from __future__ import annotations

import json
import threading
import time

import torch
from helpers import TINY, run_ptdp

from ptdp.observability import flight_recorder
from ptdp.observability.liveness import MainThread
from ptdp.observability.watchdog import NATIVE_SHARE, Watchdog, computing, diagnose

NOW, TIMEOUT, STALE = 1000.0, 5.0, 2.5


def beat(**fields) -> dict:
    """A heartbeat written 0.2 s ago by a rank silent for 10 s, waiting in communication."""
    return {"time": NOW - 0.2, "idle_s": 10.0, "iteration": 3, "seq": 5, "comm": True, "announced": None,
            "where": "ptdp/parallel/pipeline/p2p.py:120 in wait", **fields}


IN_OP = {"comm": False, "in_op": True, "where": "ptdp/ops/weight_grad.py:157 in linear"}


def test_a_rank_inside_a_long_operation_whose_cpu_time_advances_is_no_hang():
    """Rank 0 has computed one matmul for 10 s (twice the timeout), its process using 0.4 of a core; rank 1
    waits for it in a receive. The job progresses."""
    assert computing(beat(**IN_OP, cpu_share=0.4))
    assert diagnose({0: beat(**IN_OP, cpu_share=0.4), 1: beat()}, NOW, TIMEOUT, STALE) is None


def test_a_rank_whose_cpu_time_stands_still_is_a_hang():
    """The same place, but the process's CPU time stands still: nothing computes there."""
    assert not computing(beat(**IN_OP, cpu_share=0.0))
    verdict = diagnose({0: beat(**IN_OP, cpu_share=0.0), 1: beat()}, NOW, TIMEOUT, STALE)
    assert verdict.culprits == [0] and "alive but silent" in verdict.how
    assert "at ptdp/ops/weight_grad.py:157 in linear" in verdict.how


def test_stopped_blocked_and_looping_ranks_stay_hangs_whatever_their_cpu_share():
    # A stopped process: its last heartbeat said "computing", but it is older than the stale limit.
    stopped = diagnose({0: beat(**IN_OP, cpu_share=0.9, time=NOW - 6.0), 1: beat()}, NOW, TIMEOUT, STALE)
    assert stopped.culprits == [0] and "stopped responding" in stopped.how
    # Blocked in a collective past the timeout: communication is no computing (gloo's threads may spin).
    assert not computing(beat(in_op=True, cpu_share=0.9))
    assert diagnose({0: beat(in_op=True, cpu_share=0.9), 1: beat(seq=4)}, NOW, TIMEOUT, STALE).culprits == [1]
    # Looping in Python: CPU time advances, but no native call (the interpreter lock stays taken).
    looping = diagnose({0: beat(comm=False, in_op=False, cpu_share=1.0, where="x.py:9 in spin"), 1: beat()},
                       NOW, TIMEOUT, STALE)
    assert looping.culprits == [0] and "at x.py:9 in spin" in looping.how
    # A heartbeat from before these fields (a rank of an older ptdp): never computing.
    assert not computing(beat(comm=False))


def _on_main_thread(work, probe, delay_s: float = 0.4):
    """Run ``work()`` on this (the main) thread while another thread calls ``probe()`` after ``delay_s``."""
    result: list = []
    thread = threading.Thread(target=lambda: (time.sleep(delay_s), result.append(probe())))
    thread.start()
    work()
    thread.join()
    return result[0]


def _matmuls(seconds: float, stop: threading.Event | None = None) -> None:
    """Compute for ``seconds``, or until ``stop`` is set if that comes first."""
    a = torch.randn(512, 512)
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (stop and stop.is_set()):
        a = torch.tanh(a @ a)


def _python_loop(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _native_share(main: MainThread, seconds: float = 2.5) -> float:
    """What the watchdog measures over a silence: a probe every heartbeat (here 4 a second), the share over
    all of them."""
    main.forget_native()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        share = main.native_share()
        time.sleep(0.25)
    return share


def _until(measure, good, tries: int = 3) -> list[float]:
    """Up to ``tries`` measurements, the last the first that is ``good`` (or the third)."""
    seen = [measure()]
    while len(seen) < tries and not good(seen[-1]):
        seen.append(measure())
    return seen


def test_the_main_thread_is_seen_inside_native_calls_and_not_in_a_python_loop():
    """Each side in one of three silences: a take of the lock is a noisy witness on a machine loaded many
    times over (a looping main thread that waits for a core lets the lock go by), which measured a Python
    loop at 0.52 once beside two test workers and three busy loops."""
    main = MainThread()
    native = _until(lambda: _on_main_thread(lambda: _matmuls(3.0), lambda: _native_share(main), delay_s=0.2),
                    lambda share: share >= NATIVE_SHARE)
    assert native[-1] >= NATIVE_SHARE, native
    python = _until(lambda: _on_main_thread(lambda: _python_loop(3.0), lambda: _native_share(main), delay_s=0.2),
                    lambda share: share < NATIVE_SHARE)
    assert python[-1] < NATIVE_SHARE, python
    main.process_cpu_share()
    assert _on_main_thread(lambda: _matmuls(1.5), lambda: main.process_cpu_share(), delay_s=1.0) > 0.02


def test_the_heartbeat_of_a_rank_inside_a_long_operation_says_computing(tmp_path):
    """A watchdog in this process (one rank, a 1 s timeout): matmuls without a tick for longer than the
    timeout are not a hang, and the heartbeat carries the process's CPU time."""
    watchdog = Watchdog(tmp_path, 0, 1, timeout_s=1.0)
    path = tmp_path / "hang" / "heartbeat-rank0.json"
    read_it = threading.Event()

    def read() -> dict:
        """The first heartbeat silent for over the timeout (the watchdog has not exited by then). Its thread
        arms and writes when the machine lets it, so the test waits for the heartbeat, not a fixed time."""
        heartbeat: dict = {}
        deadline = time.monotonic() + 60
        while heartbeat.get("idle_s", 0.0) <= 1.5 and time.monotonic() < deadline:
            time.sleep(0.25)
            if path.exists():
                heartbeat = json.loads(path.read_text())
        read_it.set()
        return heartbeat

    try:  # one silence, as long as the reading takes
        heartbeat = _on_main_thread(lambda: _matmuls(60, read_it), read, delay_s=0.0)
    finally:
        watchdog.stop()
        flight_recorder.enable(False)
    assert heartbeat, "no heartbeat in 60 s"
    assert heartbeat["idle_s"] > 1.5 and heartbeat["in_op"] and not heartbeat["comm"], heartbeat
    assert heartbeat["cpu_share"] > 0.02 and heartbeat["cpu_s"] > 0
    assert computing(heartbeat)


def test_a_stage_computing_for_4x_the_timeout_without_a_tick_finishes(tmp_path):
    """Stage 0 spends 8 s in compute operations at the start of iteration 3 (no layer, action or
    communication ticks meanwhile) against a 2 s timeout; stage 1 waits for it all that time."""
    metrics = tmp_path / "metrics.jsonl"
    proc = run_ptdp(["train", *TINY, "--nproc-per-node", "2", "--pipeline-model-parallel-size", "2",
                     "--train-iters", "4", "--hang-timeout-s", "2", "--save", str(tmp_path / "ck"),
                     "--metrics-file", str(metrics)],
                    env={"PTDP_TEST_COMPUTE_AT_ITERATION": "3:8"}, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hang" not in proc.stderr, proc.stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    assert list(tmp_path.glob(".test-computed-*-3")), "stage 0 never computed at iteration 3"
