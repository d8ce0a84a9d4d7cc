"""The planner against the PTD-P paper's published A100 measurements (Narayanan et al., SC'21, Table 1).

Each row is evaluated at the paper's t, p, d and global batch with full recomputation and fp16, as the
paper ran it; the paper does not publish b or v per row, so we use Megatron's GPT-3 example settings
(b = 1, non-interleaved). The table is the lead's recollection of the paper (see docs/planner.md).
"""

import pytest

from ptdp.planner import ClusterSpec, GPTSpec, ParallelConfig, TrainingSpec, evaluate

# params, heads, h, layers, t, p, GPUs, global batch, measured TFLOP/s per GPU
TABLE_1 = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    ("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
GPT3_175B_1024 = ("175B", 96, 12288, 96, 8, 8, 1024, 1536, 140)  # the paper's 34-day estimate uses 140
TOLERANCE = 0.12


def _estimate(row):
    _, heads, h, layers, t, p, gpus, batch, _ = row
    model = GPTSpec(num_layers=layers, hidden_size=h, num_attention_heads=heads, seq_length=2048, vocab_size=51200)
    cfg = ParallelConfig(t, p, gpus // (t * p), 1, 1, "full")
    return evaluate(model, cfg, ClusterSpec.of("a100-80gb", gpus), TrainingSpec(batch, "fp16"))


def _table(rows) -> str:
    lines = ["row       t   p     n  model  paper  error"]
    for row in rows:
        est = _estimate(row)
        lines.append(f"{row[0]:8s} {row[4]:2d} {row[5]:3d} {row[6]:5d}  {est.tflops_per_gpu:5.1f}  {row[8]:5d}  "
                     f"{est.tflops_per_gpu / row[8] - 1:+.1%}")
    return "\n".join(lines)


def test_table_1_within_tolerance():
    errors = {row[0]: _estimate(row).tflops_per_gpu / row[8] - 1 for row in TABLE_1}
    assert all(abs(e) <= TOLERANCE for e in errors.values()), "model vs paper Table 1\n" + _table(TABLE_1)
    for row in TABLE_1:
        assert _estimate(row).fits, f"{row[0]}: the paper ran this layout, the model says it does not fit"


@pytest.mark.xfail(strict=True, reason="known miss: the model gives ~164 TFLOP/s (+17%) for 175B at (8, 8, 16); "
                                       "see docs/planner.md, 'What the model still ignores'")
def test_gpt3_175b_on_1024_gpus():
    est = _estimate(GPT3_175B_1024)
    assert est.fits
    assert abs(est.tflops_per_gpu / GPT3_175B_1024[8] - 1) <= TOLERANCE, _table([GPT3_175B_1024])
