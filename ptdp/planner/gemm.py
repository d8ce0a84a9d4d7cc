"""The time of a 16-bit GEMM on a GPU: the datasheet peak times the fraction a GEMM of that shape reaches.

The planner's compute model (``ptdp.planner.perf`` prices every layer's GEMMs with it); pure arithmetic.
"""

from __future__ import annotations

# Large 16-bit GEMMs reach ~85-90% of the datasheet peak with cuBLAS on A100/H100; a dimension x only
# fills the tensor-core tiles and SM waves in proportion x / (x + GEMM_HALF_DIM) (1024^3 -> ~69% of peak,
# 8192^3 -> ~87%, a 128-wide attention head dimension -> half). These are hardware facts, not fitted.
GEMM_MAX_EFFICIENCY = 0.9
GEMM_HALF_DIM = 96

def gemm_efficiency(m: float, n: float, k: float) -> float:
    """Achieved fraction of peak of an (m x k) @ (k x n) GEMM; symmetric, so dgrad/wgrad match the forward."""
    eff = GEMM_MAX_EFFICIENCY
    for dim in (m, n, k):
        eff *= dim / (dim + GEMM_HALF_DIM)
    return eff


def gemm_time(m: float, n: float, k: float, peak: float, batch: float = 1) -> float:
    return 2 * m * n * k * batch / (peak * gemm_efficiency(m, n, k))
