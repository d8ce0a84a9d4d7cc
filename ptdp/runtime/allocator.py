"""A one-process CPU run: the C allocator keeps the memory the process frees instead of handing it back.

glibc's ``malloc`` maps a block of 128 KiB or more from the kernel for itself and unmaps it when freed, and
gives the top of its heap back once 128 KiB there is free (both thresholds rise a little as a process runs).
A training iteration on the CPU frees and allocates the same activations and gradients every time, so each
iteration took pages back from the kernel, zeroed, one fault each: ~2,000-3,700 faults per iteration of
nanoGPT's CPU recipe in one process, 4-8% of its time (BENCHMARKS.md, "Page faults of a one-process run").
With fixed thresholds -- blocks under 32 MiB come from the heap, and up to 64 MiB free at its top stays --
the process reuses what it freed, as torch's caching allocator does on a GPU.

Only where nothing chose otherwise: ptdp's launcher pins the mmap threshold of its CPU workers
(``--cpu-mmap-threshold``, ``MALLOC_MMAP_THRESHOLD_``) so that their resident memory follows what training
holds, and a threshold the user set wins; elsewhere than glibc nothing changes.
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest dynamic value on 64-bit systems
TRIM_THRESHOLD = 64 << 20


def keep_freed_memory() -> bool:
    """Set the thresholds (module docstring) in this process unless a ``MALLOC_*_THRESHOLD_`` is set; whether
    they were set."""
    if not sys.platform.startswith("linux") or any(
            name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
