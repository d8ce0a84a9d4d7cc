"""Two torchrun agents ("nodes") meeting through c10d rendezvous train the single-process model.

Each agent starts 2 workers; with t = 2 the tensor-parallel pairs stay inside a node and the p = 2
pipeline crosses the nodes, as docs/references.md, §Configuration takeaways recommends. The rendezvous port
is picked free by the OS; both agents run in their own session and are killed on any failure.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TINY, Run, assert_equivalent, worker_env

RTOL = 1e-4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_command(port: int, run_id: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
            "--local-addr", "127.0.0.1", "--max-restarts", "0", "-m", "ptdp", "train", *args]


def stop_agent(agent: subprocess.Popen) -> None:
    """End an agent and its workers (torchrun starts each worker in a session of its own)."""
    children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children")
    workers = [int(pid) for pid in children.read_text().split()] if children.exists() else []
    os.killpg(agent.pid, signal.SIGTERM)  # torchrun's agent stops its workers on SIGTERM
    try:
        agent.wait(timeout=45)
    except subprocess.TimeoutExpired:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait(timeout=10)
    for pid in workers:  # whatever the agent left behind
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def run_two_nodes(tmp_path, args: list[str], timeout: float = 240) -> None:
    port, run_id = free_port(), f"ptdp-test-{os.urandom(4).hex()}"
    agents = []
    try:
        for node in range(2):
            log = (tmp_path / f"node{node}.log").open("w")
            command = agent_command(port, run_id, args)
            agents.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=worker_env(),
                                           start_new_session=True))
        deadline = time.monotonic() + timeout
        # Until both exit 0; one failing agent would leave the other waiting for its peer, so stop then.
        while any(a.poll() is None for a in agents) and all(a.poll() in (None, 0) for a in agents):
            if time.monotonic() > deadline:
                pytest.fail("the two-node run did not finish in time")
            time.sleep(0.2)
    finally:
        for agent in agents:
            if agent.poll() is None:
                stop_agent(agent)
    codes = [agent.returncode for agent in agents]
    if codes != [0, 0]:
        logs = "\n".join((tmp_path / f"node{n}.log").read_text()[-3000:] for n in range(2))
        pytest.fail(f"agents exited with {codes}:\n{logs}")


def test_two_nodes_with_tp_inside_each_node_match_one_process(tmp_path, reference):
    metrics, ckpt = tmp_path / "two-nodes.jsonl", tmp_path / "ckpt"
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    run_two_nodes(tmp_path, [*TINY, *layout, "--metrics-file", str(metrics), "--save", str(ckpt)])
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3]  # written by global rank 0 only
    assert_equivalent(Run(records, ckpt), reference, RTOL)


def test_tensor_parallel_group_must_fit_in_a_node(monkeypatch, capsys):
    """t = 2 with one process per node would put a TP pair across nodes: refused before any collective."""
    from ptdp.cli.main import main as ptdp_main

    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)  # what torchrun --nnodes 2 --nproc-per-node 1 sets on rank 0
    assert ptdp_main(["train", *TINY, "--tensor-model-parallel-size", "2"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "ptdp train: error: --tensor-model-parallel-size 2 does not divide the 1 processes per node "
        "(--nproc-per-node / LOCAL_WORLD_SIZE); tensor parallelism must stay inside a node: "
        "choose t dividing 1"]
