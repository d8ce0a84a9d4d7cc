"""FLOP and parameter counts against numbers derived by hand, and the hardware table lookups."""

import pytest

from ptdp.models.flops import flops_per_iteration, layer_forward_flops, parameter_count
from ptdp.runtime.hardware import (
    ACCELERATORS,
    accelerator,
    accelerator_for_device_name,
    peak_flops_for_current_device,
)

# tiny GPT: l=2, h=4, s=8, V=16, B=1 (ffn = 4h = 16)
# one layer forward: B·s·(24h² + 4sh) = 8·(384 + 128) = 4096
# logits: 2·B·s·h·V = 2·8·4·16 = 1024 forward, 3072 forward+backward
TINY = dict(num_layers=2, hidden_size=4, seq_length=8, vocab_size=16, global_batch_size=1)


def test_layer_forward_by_hand():
    assert layer_forward_flops(hidden_size=4, seq_length=8, tokens=8) == 4096


def test_eq3_with_recompute_by_hand():
    # 4 passes x 2 layers x 4096 + 3072 = 35840 = 96·8·2·16·(1 + 8/24 + 16/128) = 24576 + 8192 + 3072
    assert flops_per_iteration(**TINY, recompute=True) == 35840


def test_without_recompute_by_hand():
    # 3 passes x 2 layers x 4096 + 3072
    assert flops_per_iteration(**TINY, recompute=False) == 27648


def test_ffn_generalisation_by_hand():
    # h=4, ffn=8, s=8, B=1: per token 8h² + 4h·ffn + 4sh = 128 + 128 + 128 = 384 -> x8 tokens = 3072 forward
    got = flops_per_iteration(num_layers=1, hidden_size=4, seq_length=8, vocab_size=16, global_batch_size=1,
                              recompute=False, ffn_hidden_size=8)
    assert got == 3 * 3072 + 3072
    # ffn = 4h given explicitly is the paper's formula
    assert flops_per_iteration(**TINY, recompute=True, ffn_hidden_size=16) == 35840


def test_gpt3_175b_matches_eq3():
    B, s, layers, h, V = 1536, 2048, 96, 12288, 51200
    eq3 = 96 * B * s * layers * h**2 * (1 + s / (6 * h) + V / (16 * layers * h))
    got = flops_per_iteration(layers, h, s, V, B, recompute=True)
    assert got == pytest.approx(eq3, rel=1e-12)
    no_recompute = 72 * B * s * layers * h**2 * (1 + s / (6 * h)) + 6 * B * s * h * V
    assert flops_per_iteration(layers, h, s, V, B, recompute=False) == pytest.approx(no_recompute, rel=1e-12)


def test_parameter_count_by_hand():
    # 2·(12·16 + 13·4) + (16 + 8)·4 = 488 + 96 = 584 = 12·2·16·(1 + 13/48 + 24/96)
    assert parameter_count(2, 4, 8, 16) == 584
    # ffn=8: per layer 4h² + 2h·ffn + ffn + 9h = 64 + 64 + 8 + 36 = 172
    assert parameter_count(1, 4, 8, 16, ffn_hidden_size=8) == 172 + 96


def test_gpt3_175b_parameters():
    assert parameter_count(96, 12288, 2048, 51200) == pytest.approx(174.6e9, rel=1e-3)


def test_hardware_table():
    for name in ("a100-80gb", "a100-40gb", "h100-80gb", "h200"):
        assert name in ACCELERATORS
    assert accelerator("a100-80gb").peak_flops == 312e12
    # paper: 8 x 200 Gb/s HDR per 8-GPU node = 25 GB/s per GPU
    assert accelerator("a100-80gb").inter_node_bandwidth * 8 == 8 * 200e9 / 8
    with pytest.raises(KeyError, match="a100-80gb"):
        accelerator("v100")


@pytest.mark.parametrize(
    "device_name, expected",
    [
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100 80GB PCIe", "a100-80gb"),
        ("NVIDIA H100 80GB HBM3", "h100-80gb"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_device_name_mapping(device_name, expected):
    found = accelerator_for_device_name(device_name)
    assert (found.name if found else None) == expected


def test_peak_flops_none_on_cpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("GPU present")
    assert peak_flops_for_current_device() is None
