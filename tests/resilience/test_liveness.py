"""A hang watchdog that never kills live work. Liveness comes from compute (per layer and per
executor action on the CPU, CUDA events on a GPU) as well as communication; a job is hung only when no
rank has made progress of any kind for --hang-timeout-s, and the report says which kind of silence it saw.

Real processes for the end-to-end cases: a 2-stage pipeline whose iterations take 4x the timeout (a
sleep inside each layer of stage 0) finishes without a restart although stage 1 waits longer than the
timeout; a rank looping in Python is named, with where it loops. (A rank stopped with SIGSTOP:
tests/resilience/test_resilience.py.)"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import torch
from helpers import TINY, run_ptdp

from ptdp.config import ModelConfig
from ptdp.models import GPTModel
from ptdp.observability import flight_recorder
from ptdp.observability.flight_recorder import COMPUTE, COUNTS
from ptdp.observability.liveness import DeviceProgress, watch_layers
from ptdp.observability.watchdog import diagnose
from ptdp.train.controller import RunController

NOW = 1000.0


def beat(**fields) -> dict:
    """A heartbeat written 0.2 s ago by a rank silent for 10 s, waiting in communication."""
    return {"time": NOW - 0.2, "idle_s": 10.0, "iteration": 3, "seq": 5, "comm": True, "announced": None,
            "where": "ptdp/parallel/pipeline/p2p.py:120 in wait", **fields}


def test_diagnose_waits_while_any_rank_progresses_and_names_the_kind_of_silence():
    timeout, stale = 5.0, 2.5
    # Rank 1 computes (a layer ticked 1 s ago): rank 0's 10 s in a receive is no hang.
    assert diagnose({0: beat(), 1: beat(idle_s=1.0, comm=False)}, NOW, timeout, stale) is None
    # Rank 1's heartbeat is a poll period old and said 4.6 s: within the timeout (the wait for the next
    # heartbeat is no silence); 0.5 s later than due, it is silent for 5.1 s.
    assert diagnose({0: beat(), 1: beat(idle_s=4.6, time=NOW - 0.5)}, NOW, timeout, stale) is None
    assert diagnose({0: beat(), 1: beat(idle_s=4.6, time=NOW - 1.0)}, NOW, timeout, stale) is not None
    # Rank 0 builds an index alone (an announced phase): rank 1's wait is no hang either.
    assert diagnose({0: beat(announced="building the index"), 1: beat()}, NOW, timeout, stale) is None
    # A stopped process: its heartbeat is older than the stale limit.
    stopped = diagnose({0: beat(), 1: beat(time=NOW - 6.0)}, NOW, timeout, stale)
    assert stopped.culprits == [1] and "stopped responding (last heartbeat 6.0 s ago" in stopped.how
    assert diagnose({0: beat(), 1: None}, NOW, timeout, stale).how.startswith("stopped responding (no heartbeat yet")
    # Alive, silent and not in communication: a loop in its own code, named with where it is.
    looping = diagnose({0: beat(), 1: beat(comm=False, where="x.py:9 in spin")}, NOW, timeout, stale)
    assert looping.culprits == [1] and "not waiting in communication, at x.py:9 in spin" in looping.how
    # Everyone waits in communication: the ranks at the fewest operations (a collective never reached).
    behind = diagnose({0: beat(), 1: beat(seq=4), 2: beat(seq=4)}, NOW, timeout, stale)
    assert behind.culprits == [1, 2] and "every rank waits in communication" in behind.how


def test_a_late_heartbeat_of_a_process_running_on_this_host_is_no_stop():
    """On a loaded machine a computing rank's heartbeat thread can wait longer for a CPU than the stale limit:
    a process that runs here (not SIGSTOPped) gets ``timeout_s`` more before it counts as stopped, and its
    heartbeat's lateness is no silence; a stopped one gets neither, nor does a process on another host
    (judged by its heartbeat's age alone)."""
    timeout, stale = 2.0, 1.5
    child = subprocess.Popen(["sleep", "60"])
    try:
        here = {"pid": child.pid, "host": socket.gethostname(), "comm": False, "in_op": True, "cpu_share": 0.9}
        late = beat(time=NOW - 2.5, idle_s=0.3, **here)  # computing, its heartbeat 1 s past the stale limit
        assert diagnose({0: beat(), 1: late}, NOW, timeout, stale) is None
        # Ticking 1.8 s before a heartbeat written 1.2 s ago: the heartbeat's lateness is no silence here.
        assert diagnose({0: beat(), 1: beat(time=NOW - 1.2, idle_s=1.8, pid=child.pid, host=here["host"])},
                        NOW, timeout, stale) is None
        assert diagnose({0: beat(), 1: beat(time=NOW - 1.2, idle_s=1.8)}, NOW, timeout, stale) is not None
        way_late = beat(time=NOW - 4.0, idle_s=0.3, **here)  # past stale + timeout: stopped after all
        assert diagnose({0: beat(), 1: way_late}, NOW, timeout, stale).culprits == [1]
        elsewhere = diagnose({0: beat(), 1: {**late, "host": "another-node"}}, NOW, timeout, stale)
        assert elsewhere.culprits == [1] and "stopped responding" in elsewhere.how
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "T":
            assert time.monotonic() < deadline, "the child never stopped"
            time.sleep(0.01)
        stopped = diagnose({0: beat(), 1: late}, NOW, timeout, stale)
        assert stopped.culprits == [1] and "stopped responding (last heartbeat 2.5 s ago" in stopped.how
    finally:
        child.kill()
        child.wait()


class FakeEvent:
    """A CUDA event whose completion the test decides (``cudaEventQuery`` never blocks, neither does this)."""

    def __init__(self, gpu: list[int]) -> None:
        self.gpu, self.mark = gpu, None

    def record(self) -> None:
        self.gpu[1] += 1
        self.mark = self.gpu[1]  # the number of the action this event follows

    def query(self) -> bool:
        return self.mark <= self.gpu[0]


def test_device_progress_counts_completed_work_without_waiting():
    gpu = [0, 0]  # [actions the GPU has finished, actions recorded]
    device = DeviceProgress(size=4, make_event=lambda: FakeEvent(gpu))
    for _ in range(3):
        device.mark()
    assert device.completed() == 0  # the host ran ahead; nothing finished on the device yet
    gpu[0] = 2
    assert device.completed() == 2
    for _ in range(7):  # the ring (4 events) is reused: the oldest events now stand for later actions
        device.mark()
    assert device.completed() == 2  # never more than the device really finished
    gpu[0] = 7
    assert device.completed() == 7
    gpu[0] = 10
    assert device.completed() == 10


def test_every_layer_ticks_in_the_forward_and_in_the_backward():
    cfg = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, hidden_dropout=0.0,
                      attention_dropout=0.0)
    model = GPTModel(cfg, 64, 64)
    handles = watch_layers([model])
    tokens = torch.randint(0, 64, (2, 16))
    before = COUNTS[COMPUTE]
    out = model(tokens)
    forward = COUNTS[COMPUTE] - before
    assert forward >= cfg.num_layers + 1  # each layer, and the chunk
    out.float().sum().backward()
    assert COUNTS[COMPUTE] - before - forward >= cfg.num_layers  # each layer's backward
    for handle in handles:
        handle.remove()
    before = COUNTS[COMPUTE]
    model(tokens)
    assert COUNTS[COMPUTE] == before  # removed: nothing on the path any more


def test_the_recorder_keeps_no_tensor_and_costs_nothing_without_a_watchdog():
    flight_recorder.enable(False)
    seq = COUNTS[flight_recorder.COMM]
    flight_recorder.record("all_reduce", tensor=torch.zeros(2, 3))
    assert COUNTS[flight_recorder.COMM] == seq  # off: returns at once
    flight_recorder.enable()
    try:
        flight_recorder.record("p2p", tensor=[torch.zeros(2), torch.zeros(4, dtype=torch.bfloat16)], peer=[1])
        op = flight_recorder.last_operations()[-1]
        assert op["kind"] == "p2p" and op["shape"] == [[2], [4]] and op["bytes"] == 2 * 4 + 4 * 2
    finally:
        flight_recorder.enable(False)


# ----------------------------------------------------------------------------------- real processes

P2 = ["--nproc-per-node", "2", "--pipeline-model-parallel-size", "2"]


def _watch_heartbeats(hang_dir, rank: int, seen: list[float], stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            seen.append(json.loads((hang_dir / f"heartbeat-rank{rank}.json").read_text())["idle_s"])
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)


def test_a_pipeline_whose_iterations_take_4x_the_timeout_finishes_without_a_restart(tmp_path):
    """Stage 0 sleeps 0.25 s in each layer's forward (8 layers x 2 microbatches per iteration): iterations
    of 4 s against a 1 s timeout (the watchdog is armed from iteration 2: two armed iterations). Stage 1 waits about 2 s for each microbatch, twice the timeout, which is
    no hang while stage 0 ticks. Stage 0 ticks twice per heartbeat period (POLL_S), so each of its
    heartbeats says "progress just now": only a heartbeat 1 s overdue (a watchdog thread starved that long
    on a loaded machine) would read as silence; with 0.5 s a layer, some heartbeats said 0.5 s and half
    that lateness was enough. Without the layer ticks, stage 0's 2 s forwards are silences: a hang."""
    ckpt, metrics = tmp_path / "ck", tmp_path / "metrics.jsonl"
    seen: list[float] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_heartbeats, args=(tmp_path / "ck.run" / "hang", 1, seen, stop))
    watcher.start()
    try:
        proc = run_ptdp(["train", *TINY, *P2, "--num-layers", "16", "--global-batch-size", "4", "--train-iters", "3",
                         "--hang-timeout-s", "1", "--max-restarts", "1",
                         "--save", str(ckpt), "--load", str(ckpt), "--metrics-file", str(metrics)],
                        env={"PTDP_TEST_SLOW_LAYER": "0:0.25"}, check=False, timeout=300)
    finally:
        stop.set()
        watcher.join()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hang" not in proc.stderr and "restarting" not in proc.stderr, proc.stderr[-3000:]
    assert " loaded checkpoint" not in proc.stdout  # no restart
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert all(r["iteration_time_s"] >= 4 for r in records)
    assert max(seen, default=0.0) > 1.0, seen  # stage 1 really was silent longer than the timeout


def test_a_new_job_forgets_old_reports_and_a_rank_failing_after_a_report_exits_3(tmp_path, monkeypatch):
    """The reporter's exit closes the connection a peer waits on; the peer's step raises before its own
    watchdog sees the hang: it must exit 3 without a traceback (the report stays the one line, which the
    next test asserts when the looping rank reports itself). An earlier job's report, left beside the same
    --save, must neither silence this job's errors nor its own report."""
    hang = tmp_path / "hang"
    hang.mkdir()
    (hang / "report-attempt0.txt").write_text("hang: an earlier job's\n")
    (hang / "rank1-ops.json").write_text("{}")
    (hang / "heartbeat-rank1.json").write_text("{}")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)
    controller = RunController(0, 2, torch.device("cpu"), False, 300.0, tmp_path)
    try:
        assert sorted(p.name for p in hang.iterdir()) == []  # a new job: the old reports are gone
        controller.before_iteration(1)
        controller.before_iteration(2)  # the watchdog is armed
        controller.failed()
        assert exits == []  # no report: this rank's own error, raised as it is
        (hang / "report-attempt0.txt").write_text("hang: rank(s) 1 ...\n")  # a peer reported, then left
        controller.failed()
        assert exits == [3]
    finally:
        controller.close()


def test_a_rank_looping_in_python_is_named_with_where_it_loops(tmp_path):
    ckpt = tmp_path / "ck"
    proc = run_ptdp(["train", *TINY, *P2, "--train-iters", "6", "--hang-timeout-s", "2", "--save", str(ckpt)],
                    env={"PTDP_TEST_LOOP_AT_ITERATION": "3"}, check=False, timeout=300)
    assert proc.returncode == 3, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]  # the report, nothing from torchrun or the launcher
    assert lines[0].startswith("ptdp train: error: hang: rank(s) 1 alive but silent"), lines[0]
    assert "not waiting in communication, at tests/faults/sitecustomize.py" in lines[0], lines[0]
    assert "in loop_at_iteration" in lines[0] and "(--hang-timeout-s)" in lines[0]
    report = tmp_path / "ck.run" / "hang"
    assert json.loads((report / "rank1-ops.json").read_text())["comm"] is False
