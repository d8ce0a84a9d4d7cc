"""Elastic training: ``ptdp train --nnodes 1:2`` agents lose a node, go on at d = 1, and grow back to d = 2.

Two agents ("nodes") of 2 workers each train t = 1, p = 2, d = 2 through a c10d rendezvous whose store the
test itself hosts (on a port the OS picks), so either agent can die without taking the store along. One
agent is SIGKILLed with its workers; the survivor's workers fail on the lost peer, torchrun's agent
restarts them as d = 1 (m doubles, the global batch is kept) from the latest checkpoint. A third agent
then joins: the survivor's agent sees it waiting, stops its workers (SIGTERM: they save first) and both
restart as d = 2. Every iteration after each reshard must have the loss of a fresh run of the new size
loaded from that same checkpoint: d only changes the order of fp32 sums.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from helpers import GLOBAL_BATCH, TINY, assert_same_run, run_layouts, run_ptdp, worker_env

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from elastic import kill  # noqa: E402  (the benchmark's: SIGKILL an agent and its workers)

RTOL = 1e-4
ITERS = 28  # the join (an agent start and a rendezvous round) takes about 8 iterations here
LAYOUT = ["--pipeline-model-parallel-size", "2"]
# Quick rendezvous: a node is dead after 5 missed 1-s heartbeats (fewer drop a busy live agent); a round
# closes 3 s after quorum (so both agents, started together, make the first round).
RDZV_CONF = "is_host=0,last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=5,join_timeout=120"


def _wait(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def _resumed_at(log: str, change: str) -> int:
    """The iteration of the checkpoint a restart resharded from, by its ``... to t=1 p=2 d=N`` line."""
    return int(re.search(rf"loaded checkpoint \S+ at iteration (\d+)\n resharded the checkpoint {change}",
                         log).group(1))


def test_elastic_scale_down_and_up_keeps_the_losses(tmp_path):
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    args = ["train", *TINY, *LAYOUT, "--train-iters", str(ITERS), "--save", str(ckpt), "--load", str(ckpt),
            "--save-interval", "1", "--metrics-file", str(metrics), "--nnodes", "1:2", "--nproc-per-node", "2",
            "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-id", "elastic-test", "--rdzv-conf", RDZV_CONF,
            "--monitor-interval", "0.1", "--max-restarts", "2"]
    env = {**worker_env(), "PTDP_TEST_SLOW_RANK": "*:0.2"}  # a few seconds of training to kill a node in
    agents: dict[str, subprocess.Popen] = {}

    def start(name: str) -> None:
        log = (tmp_path / f"{name}.log").open("w")
        agents[name] = subprocess.Popen([sys.executable, "-m", "ptdp", *args], stdout=log, stderr=subprocess.STDOUT,
                                        env=env, start_new_session=True)

    def logs() -> str:
        return "".join((tmp_path / f"{name}.log").read_text() for name in agents)

    down, up = "from t=1 p=2 d=2 to t=1 p=2 d=1", "from t=1 p=2 d=1 to t=1 p=2 d=2"
    try:
        start("a")
        start("b")
        _wait(lambda: (ckpt / "iter_0000002").exists(), "the first checkpoints at d = 2")
        kill(agents["b"])  # for good: its node is gone
        _wait(lambda: down in logs(), "the survivor's restart at d = 1")
        shrunk = _resumed_at(logs(), down)
        _wait(lambda: (ckpt / f"iter_{shrunk + 2:07d}").exists(), "two iterations at d = 1")
        start("c")  # a new node joins the running job
        _wait(lambda: up in logs(), "the restart at d = 2 with the new node")
        grown = _resumed_at(logs(), up)
        _wait(lambda: agents["a"].poll() is not None and agents["c"].poll() is not None, "the end of training",
              timeout=180)
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                kill(agent)
    assert (agents["a"].returncode, agents["c"].returncode) == (0, 0), logs()[-4000:]
    assert shrunk < grown < ITERS

    by_iteration = {}
    for record in map(json.loads, metrics.read_text().splitlines()):
        by_iteration[record["iteration"]] = record  # a restarted iteration: its last (resumed) record counts
    assert sorted(by_iteration) == list(range(1, ITERS + 1))
    assert [by_iteration[i]["consumed_samples"] for i in range(1, ITERS + 1)] == [GLOBAL_BATCH * i for i in range(1, ITERS + 1)]

    # The references: fresh runs of each new size loaded from the checkpoint that size resumed from; the d = 1
    # one stops where the job grew (the same --train-iters keeps the learning-rate schedule). Both in one spawn.
    plan = {}
    for resumed, nproc, stop in ((shrunk, 2, grown), (grown, 4, ITERS)):
        start_ckpt = tmp_path / f"start-{resumed}"
        shutil.copytree(ckpt / f"iter_{resumed:07d}", start_ckpt)
        plan[f"d{nproc // 2}"] = (nproc, [*LAYOUT, "--train-iters", str(ITERS), "--load", str(start_ckpt),
                                          "--exit-interval", str(stop)])
    references = run_layouts(tmp_path / "references", plan, save=False)  # compared by their records
    for (resumed, stop), reference in zip(((shrunk, grown), (grown, ITERS)), references.values(), strict=True):
        assert [r["iteration"] for r in reference.records] == list(range(resumed + 1, stop + 1))
        got = [by_iteration[i] for i in range(resumed + 1, stop + 1)]
        assert_same_run(got, reference, RTOL)


def test_a_world_size_that_cannot_hold_the_layout_names_the_ones_that_can(monkeypatch, capsys):
    """An elastic restart at 3 processes cannot hold p = 2: one line naming the world sizes that work."""
    from ptdp.cli.main import main as ptdp_main

    for name, value in {"WORLD_SIZE": "3", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3"}.items():
        monkeypatch.setenv(name, value)  # what torchrun sets on rank 0 of a 3-worker restart
    assert ptdp_main(["train", *TINY, *LAYOUT, "--elastic"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "ptdp train: error: world size 3 cannot run this job (world size 3 is not divisible by "
        "--tensor-model-parallel-size x --pipeline-model-parallel-size = 1x2; use a world size that is a multiple "
        "of 2); these would: --nproc-per-node 2, 4, 8"]


def test_nnodes_range_needs_a_rendezvous_endpoint():
    proc = run_ptdp(["train", *TINY, "--nnodes", "1:2", "--nproc-per-node", "2"], timeout=60, check=False)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "ptdp train: error: --nnodes 1:2 needs --rdzv-endpoint HOST:PORT, where the agents meet"]
