"""``--cpu-mmap-threshold``: the launcher pins glibc's mmap threshold for CPU workers (BENCHMARKS.md, CPU
allocator), keeps a user's own ``MALLOC_MMAP_THRESHOLD_``, and 0 leaves glibc's dynamic threshold."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import worker_env

from ptdp.cli.main import _worker_argv, build_parser
from ptdp.runtime import interrupt, launch


@pytest.fixture
def launched(monkeypatch):
    """``launch_workers`` with torchrun's ``run`` replaced: the environment the workers would inherit."""
    import torch.distributed.run as torchrun

    seen = {}
    monkeypatch.setattr(torchrun, "run", lambda _args: seen.update(env=dict(__import__("os").environ)))
    monkeypatch.setattr(interrupt, "install_launcher", lambda *_: None)
    monkeypatch.setattr(interrupt, "launcher_interrupted", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)

    def run(threshold: int, **env) -> dict:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        assert launch.launch_workers(2, 0, ["train"], None, cpu_mmap_threshold=threshold) == 0
        return seen["env"]

    return run


def test_cpu_workers_get_the_pinned_threshold(launched):
    assert launched(65536)["MALLOC_MMAP_THRESHOLD_"] == "65536"


def test_a_users_threshold_is_kept_and_zero_sets_none(launched, monkeypatch):
    assert launched(65536, MALLOC_MMAP_THRESHOLD_="1048576")["MALLOC_MMAP_THRESHOLD_"] == "1048576"
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    assert "MALLOC_MMAP_THRESHOLD_" not in launched(0)


def test_the_flag_is_the_launchers_and_a_bad_value_is_one_line():
    assert build_parser().parse_args(["train"]).cpu_mmap_threshold == 1 << 20  # the default (BENCHMARKS.md)
    assert _worker_argv(["ptdp", "train", "--cpu-mmap-threshold", "0", "--num-layers", "2"]) == \
        ["train", "--num-layers", "2"]
    proc = subprocess.run([sys.executable, "-m", "ptdp", "train", "--cpu-mmap-threshold", "-1"], capture_output=True,
                          text=True, env=worker_env(), timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("--cpu-mmap-threshold: expected a number of bytes >= 0, "
                                                         "got '-1'")
