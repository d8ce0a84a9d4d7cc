"""MXFP4 (the OCP microscaling format) as GPT-OSS's published checkpoints store their expert weights:
``*_blocks`` (uint8, two 4-bit e2m1 values a byte, the low nibble first) and ``*_scales`` (uint8, one
power-of-two exponent, biased by 127, per block of 32 values). Import and ``--load HF_DIR`` dequantize them
to full precision (the recipe op ``ptdp.models.hf_recipe.MXFP4``, only the rows and blocks a rank reads);
ptdp trains the dequantized weights (it does not train in FP4). The format is not GPT-OSS's own, so it
lives beside the recipes rather than in the family's folder."""

from __future__ import annotations

import torch

# The 16 e2m1 values by their 4-bit code: sign bit 3, then exponent and mantissa.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``blocks [..., rows, G, 16]`` and ``scales [..., rows, G]`` → fp32 ``[..., rows, G·32]``: each row's
    32·G values in order. Any leading dimensions, any subset of rows and blocks (a rank's box) decode
    alone. ValueError when the shapes do not pair."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
                         "(one scale per block of 16 bytes)")
    codes = blocks.to(torch.uint8)
    table = torch.tensor(E2M1, dtype=torch.float32)
    values = torch.stack([table[(codes & 0x0F).long()], table[(codes >> 4).long()]], dim=-1).flatten(-2)
    values = torch.ldexp(values, (scales.to(torch.int32) - SCALE_BIAS).unsqueeze(-1))
    return values.flatten(-2)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``blocks [E, rows, G, 16]`` and ``scales [E, rows, G]`` → ``[E, G·32, rows]``: :func:`dequantize_rows`
    with the last two dimensions swapped, the layout of HF's unquantized ``gate_up_proj [E, h, 2f]`` and
    ``down_proj [E, f, h]``. ValueError when the shapes do not pair."""
    return dequantize_rows(blocks, scales).transpose(1, 2).to(dtype).contiguous()
