"""What Muon's step costs one rank, in shapes and bytes, for ``ptdp plan --optimizer muon``'s iteration time.

Each hidden matrix is orthogonalised once, whole, on one rank of its grid (``ptdp.optim.muon_exchange``): the
dense matrices over the t x (d·c/K) ranks of a pipeline stage, each expert's over the etp x edp/K ranks of
its expert-parallel index. With the owners balanced by FLOPs (longest processing time first), a rank does
about 1/grid of its stage's Newton–Schulz work, 2·steps·(2mn² + n³) FLOPs per m x n matrix, n <= m
(docs/references.md, §Muon). The exchange carries fp32. Under ZeRO a rank holds 1/D of its tensor-parallel
slices and owns 1/D of the matrices, so each all_to_all (data-parallel gather, scatter) moves about 1/D of
its slices per rank; without ZeRO there is no gather and the scatter is the owners' broadcast of their
results, an all-gather of the whole slices. The tensor-parallel gather and scatter move the 1/D of the
slices whose data-parallel owner the rank is. ``ptdp.planner.perf`` turns these into seconds with its GEMM
and ring models.
"""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.planner.experts import expert_data_parallel_size, expert_sizes
from ptdp.planner.spec import GPTSpec, ParallelConfig

NS_STEPS = 5  # --muon-num-ns-steps' default (Megatron-Core's)
FP32 = 4


@dataclass(frozen=True)
class MuonWork:
    """One rank's share of Muon's step over ``layers`` transformer layers: Newton–Schulz matrices as
    (rows, cols, how many this rank orthogonalises, fractional), and the fp32 bytes a rank exchanges, both
    ways together, as all-gathers of that size: over the data-parallel group of ``dp`` ranks
    (``dp_bytes``) and the tensor-parallel one (``tp_bytes``)."""

    matrices: tuple[tuple[int, int, float], ...]
    dp_bytes: float
    dp: int
    tp_bytes: float


def _attention(model: GPTSpec) -> list[tuple[int, int, int]]:
    h = model.hidden_size  # Q, K and V apart (split_qkv), then the output projection
    return [(model.q_width, h, 1), (model.kv_width, h, 2), (h, model.q_width, 1)]


def _mlp(h: int, ffn: int, swiglu: bool) -> list[tuple[int, int, int]]:
    return [(ffn, h, 2 if swiglu else 1), (h, ffn, 1)] if ffn else []  # gate and up apart


def muon_work(model: GPTSpec, cfg: ParallelConfig, layers: float) -> MuonWork:
    """The Newton–Schulz matrices and exchange bytes of one rank holding ``layers`` layers (mean over dense
    and MoE layers by their counts)."""
    t, h, k = cfg.tensor_model_parallel_size, model.hidden_size, cfg.distributed_optimizer_instances
    d = max(cfg.data_parallel_size * cfg.context_parallel_size // k, 1)  # the grid's data-parallel side
    moe = model.moe
    moe_share = moe.moe_layers / model.num_layers if moe else 0.0
    dense = _attention(model) + [(r, c, n * (1 - moe_share)) for r, c, n in _mlp(h, model.ffn, model.swiglu)]
    expert: list[tuple[int, int, float]] = []
    if moe:
        dense += [(r, c, n * moe_share) for r, c, n in [(moe.num_experts, h, 1), *_mlp(h, moe.shared_ffn, model.swiglu)]]
        e, etp = expert_sizes(cfg)
        edp = expert_data_parallel_size(cfg)
        edp = edp // k if edp % k == 0 else edp
        local = moe.num_experts / e * moe_share  # experts of this expert-parallel index, per layer
        expert = [(r, c, n * local / (etp * edp)) for r, c, n in _mlp(h, moe.ffn, model.swiglu)]
    matrices = [(r, c, n * layers / (t * d)) for r, c, n in dense] + [(r, c, n * layers) for r, c, n in expert]
    held = sum(r * c * n for r, c, n in dense) * layers / t
    if moe:
        held += sum(r * c * n for r, c, n in _mlp(h, moe.ffn, model.swiglu)) * local * layers / etp
    dp_bytes = 2 * held / d if cfg.strategy != "no_shard" else held  # gather + scatter of 1/D, or the broadcast
    return MuonWork(tuple(matrices), dp_bytes * FP32, d, 2 * held * FP32 / d if t > 1 else 0.0)
