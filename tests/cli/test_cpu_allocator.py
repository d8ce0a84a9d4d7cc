"""``--cpu-mmap-threshold``: the launcher pins glibc's mmap threshold for CPU workers (BENCHMARKS.md, CPU
allocator), keeps a user's own ``MALLOC_MMAP_THRESHOLD_``, and 0 leaves glibc's dynamic threshold."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import worker_env

from ptdp.cli.main import _worker_argv, build_parser
from ptdp.runtime import launch, launcher_stop


@pytest.fixture
def launched(monkeypatch):
    """``launch_workers`` with torchrun's ``run`` replaced: the environment the workers would inherit."""
    import torch.distributed.run as torchrun

    seen = {}
    monkeypatch.setattr(torchrun, "run", lambda _args: seen.update(env=dict(__import__("os").environ)))
    monkeypatch.setattr(launcher_stop, "install_launcher", lambda *_: None)
    monkeypatch.setattr(launcher_stop, "launcher_interrupted", lambda: False)
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


_FAULTS = """
import resource, sys
from ptdp.runtime import allocator
print(allocator.keep_freed_memory() if sys.argv[1] == "keep" else None)
for _ in range(3):
    blocks = [bytearray(4 << 20) for _ in range(4)]  # an iteration's activations: allocated, written, freed
    del blocks
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    blocks = [bytearray(4 << 20) for _ in range(4)]
    del blocks
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_one_process_run_reuses_what_it_freed_without_page_faults():
    """Four 4 MiB blocks allocated and freed again and again: by default glibc gives the freed top of its heap
    back to the kernel each time (its trim threshold follows the mmap threshold to 8 MiB), and takes the pages
    back with a fault each (4,096 per round); with ``keep_freed_memory`` the heap keeps them
    (ptdp/runtime/allocator.py)."""
    env = {k: v for k, v in worker_env().items() if not k.startswith("MALLOC_")}
    faults = {}
    for mode in ("default", "keep"):
        out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, env=env,
                             check=True).stdout.split()
        faults[mode] = int(out[1])
        assert out[0] == ("True" if mode == "keep" else "None")
    assert faults["default"] > 20 * 2000 and faults["keep"] < 100, faults
