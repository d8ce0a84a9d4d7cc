"""Accelerators and the servers they come in: the hardware facts the planner and the trainer's MFU use.

Numbers are vendor datasheet values (dense 16-bit tensor-core peak, no sparsity). Bandwidths are per GPU
and per direction, in bytes/s:

* intra-node: NVLink through NVSwitch. A100: 12 NVLink3 links x 25 GB/s = 300 GB/s; H100/H200: 18 NVLink4
  links x 25 GB/s = 450 GB/s. H800 (the export H100 DeepSeek-V3 trained on): the H100's compute and HBM
  with 400 GB/s of NVLink in both directions together, 200 GB/s each way (the report measures ~160 GB/s).
* inter-node: one NIC per GPU, as in DGX servers (docs/references.md, §Hardware: 8 x 200 Gb/s HDR InfiniBand
  per A100 node = 25 GB/s per GPU; 8 x 400 Gb/s NDR per H100/H200 node = 50 GB/s per GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class Accelerator:
    """One GPU model and the default server it sits in."""

    name: str
    peak_flops: float  # dense 16-bit tensor-core FLOP/s
    memory_bytes: int  # device memory
    memory_bandwidth: float  # HBM bytes/s
    intra_node_bandwidth: float  # NVLink/NVSwitch bytes/s per GPU per direction
    inter_node_bandwidth: float  # network bytes/s per GPU per direction
    gpus_per_node: int = 8


ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator("a100-40gb", 312e12, 40 * GIB, 1.555e12, 300e9, 25e9),
        Accelerator("a100-80gb", 312e12, 80 * GIB, 2.039e12, 300e9, 25e9),
        Accelerator("h100-80gb", 989e12, 80 * GIB, 3.35e12, 450e9, 50e9),
        Accelerator("h100-pcie", 756e12, 80 * GIB, 2.0e12, 300e9, 50e9),  # NVLink bridge pairs only
        Accelerator("h200", 989e12, 141 * 10**9, 4.8e12, 450e9, 50e9),
        Accelerator("h800", 989e12, 80 * GIB, 3.35e12, 200e9, 50e9),  # 8 x 400 Gb/s InfiniBand per node
    )
}


def accelerator(name: str) -> Accelerator:
    """Look up a table entry by name (``a100-80gb``, ``h100-80gb``, ...); KeyError lists the choices."""
    try:
        return ACCELERATORS[name]
    except KeyError:
        raise KeyError(f"unknown GPU {name!r}; choose one of {', '.join(ACCELERATORS)}") from None


def accelerator_for_device_name(device_name: str) -> Accelerator | None:
    """Map a CUDA device name (e.g. "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3") to the table."""
    name = device_name.upper()
    if "H200" in name:  # includes GH200
        return ACCELERATORS["h200"]
    if "H800" in name:
        return ACCELERATORS["h800"]
    if "H100" in name:
        return ACCELERATORS["h100-pcie" if "PCIE" in name else "h100-80gb"]
    if "A100" in name:
        return ACCELERATORS["a100-80gb" if "80GB" in name else "a100-40gb"]
    return None


def peak_flops_for_current_device() -> float | None:
    """Dense 16-bit peak FLOP/s of the current CUDA device, or None on CPU / unknown GPUs (no MFU then)."""
    import torch

    if not torch.cuda.is_available():
        return None
    found = accelerator_for_device_name(torch.cuda.get_device_name())
    return None if found is None else found.peak_flops
