"""Muon's orthogonalisation of one whole matrix: the Newton–Schulz iteration and the update's scale.

Megatron-Core's Muon (``emerging_optimizers``' ``newton_schulz`` and ``get_muon_scale_factor``, selected by
``--muon-coefficient-type``, ``--muon-num-ns-steps``, ``--muon-fp32-matmul-prec``, ``--muon-scale-mode``,
``--muon-extra-scale-factor``) and ``torch.optim.Muon`` (``coefficient_type="simple"``, precision ``low``,
scale ``shape_scaling``: its ``adjust_lr_fn=None``; ``spectral`` with factor 0.2: its ``match_rms_adamw``)
are the same iteration (docs/references.md, §Muon): on ``X = M / ‖M‖_F``, transposed so that it is wide,
``A = X Xᵀ; B = bA + cA²; X ← aX + BX`` per step, with one ``(a, b, c)`` per step. The precisions differ
in where the cast to bf16 happens, which is why ``--muon-fp32-matmul-prec`` has three values here:

* ``low``: cast to bf16 first, normalise and iterate in bf16 (``torch.optim.Muon``'s arithmetic, to the bit);
* ``medium`` (Megatron's default): normalise in fp32, iterate in bf16 (emerging_optimizers' "medium");
* ``high``: fp32 throughout.

Each call orthogonalises one full matrix; ``ptdp.optim.muon_exchange`` decides which rank calls it on which
matrix, so that every matrix is orthogonalised once, whole, whatever the layout.
"""

from __future__ import annotations

import torch

EPS = 1e-7  # torch.optim.Muon's and emerging_optimizers' clamp of the Frobenius norm

# (a, b, c) per step; "simple" repeats its one triple, "quintic" and "aol" cycle theirs (steps a multiple of
# their length), "polar_express" repeats its last beyond its eight (steps >= 8): emerging_optimizers' sets.
COEFFICIENTS: dict[str, tuple[tuple[float, float, float], ...]] = {
    "simple": ((3.4445, -4.7750, 2.0315),),  # Keller Jordan's; torch.optim.Muon's
    "quintic": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)),  # modded-nanogpt's
    "polar_express": ((8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                      (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)),  # arXiv:2505.16932
    "aol": ((4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
            (2.7215, -3.0494, 1.3169)),
}


def coefficient_schedule(kind: str, steps: int) -> list[tuple[float, float, float]]:
    """The ``(a, b, c)`` of each of ``steps`` iterations (``ptdp.config.validate`` checks the count first)."""
    sets = list(COEFFICIENTS[kind])
    if kind == "simple":
        return sets * steps
    if kind == "polar_express":
        return sets + sets[-1:] * (steps - len(sets))
    return sets * (steps // len(sets))


@torch.no_grad()
def newton_schulz(x: torch.Tensor, schedule: list[tuple[float, float, float]], precision: str = "medium") -> torch.Tensor:
    """The orthogonalised ``x`` (2-D, any orientation), fp32 and shaped like ``x``: ``U S' Vᵀ`` with the
    singular values pushed towards 1 (module docstring for ``precision``)."""
    tall = x.size(0) > x.size(1)
    if precision == "low":  # torch.optim.Muon: bf16 from the start, the norm in bf16 too
        y = x.bfloat16()
        y = y.T if tall else y
        y = y.div(y.norm().clamp(min=EPS))
    else:
        y = x.float().T if tall else x.float()
        y = y / y.norm().clamp(min=EPS)
        if precision == "medium":
            y = y.bfloat16()
    for a, b, c in schedule:
        gram = y @ y.T
        y = torch.addmm(y, torch.addmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
    y = y.float()
    return y.T if tall else y


def scale_factor(rows: int, cols: int, mode: str, extra: float = 1.0) -> float:
    """``--muon-scale-mode`` (Megatron-Core's ``get_muon_scale_factor``) times ``--muon-extra-scale-factor``:
    ``spectral`` √max(m, n) (Moonshot's, with 0.2 it matches AdamW's update RMS), ``shape_scaling``
    √max(1, m/n) (Keller Jordan's, torch.optim.Muon's default), ``unit_rms_norm`` √(m/n)."""
    if mode == "spectral":
        base = max(rows, cols) ** 0.5
    elif mode == "shape_scaling":
        base = max(1.0, rows / cols) ** 0.5
    elif mode == "unit_rms_norm":
        base = (rows / cols) ** 0.5
    else:
        raise ValueError(f"unknown Muon scale mode {mode!r}")
    return base * extra


def newton_schulz_flops(rows: int, cols: int, steps: int) -> float:
    """Multiply-add FLOPs of ``steps`` iterations on an m×n matrix (n <= m after the transpose):
    2·steps·(2mn² + n³) (docs/references.md, §Muon), what the owners are balanced by."""
    m, n = max(rows, cols), min(rows, cols)
    return 2.0 * steps * (2.0 * m * n * n + n ** 3)
