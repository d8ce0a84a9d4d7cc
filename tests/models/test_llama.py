"""The Llama-family model (RoPE, RMSNorm, SwiGLU, GQA with G < heads, untied output, no biases) trains
the same model in every layout as in one process (per iteration the loss and the gradient norm, at the
end the weights), and its checkpoints reshard.

To stay cheap on two cores, every layout runs inside ONE spawn of 8 processes (``helpers.run_layouts``).
Short runs use ``--lr-decay-iters 6`` so their learning rates are the first three of the six-iteration
reference's; a three-iteration reference gives their final weights.
"""

from __future__ import annotations

import pytest
from helpers import assert_equivalent, assert_same_run, run_layouts

from ptdp.cli.main import build_parser, main
from ptdp.config import config_from_args

RTOL = 1e-4  # fp32: other layouts sum in other orders
LLAMA = ["--model", "tiny-llama", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
         "--lr-warmup-iters", "1", "--lr-decay-iters", "6", "--log-interval", "1"]
SIX, THREE = ["--train-iters", "6"], ["--train-iters", "3"]
SHORT = ["t2", "p2d2v2_interleaved", "t2p2d2_sp_distopt"]  # three iterations, compared with "reference3"


def layout(t: int, p: int, v: int = 1, schedule: str | None = None) -> list[str]:
    out = ["--tensor-model-parallel-size", str(t), "--pipeline-model-parallel-size", str(p),
           "--virtual-pipeline-model-parallel-size", str(v)]
    return out + (["--pipeline-schedule", schedule] if schedule else [])


def plan(ckpt) -> dict[str, tuple[int, list[str]]]:
    """name: (world size, flags); d = world / (t·p)."""
    return {
        "reference": (1, SIX),
        "reference3": (1, THREE),
        "t2": (2, [*THREE, *layout(2, 1), "--recompute-granularity", "full"]),
        "t2p2_1f1b_save": (4, [*SIX, *layout(2, 2, schedule="1f1b"), "--save", str(ckpt), "--exit-interval", "3"]),
        "t1p4v2_resume": (4, [*SIX, *layout(1, 4, 2, "interleaved"), "--load", str(ckpt)]),
        "p2d2v2_interleaved": (4, [*THREE, *layout(1, 2, 2, "interleaved")]),
        "t2p2d2_sp_distopt": (8, [*THREE, *layout(2, 2), "--sequence-parallel", "--use-distributed-optimizer",
                                  "--recompute-granularity", "full"]),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama")
    return run_layouts(tmp, plan(tmp / "ckpt"), base=LLAMA)


@pytest.mark.parametrize("name", [*SHORT, "t2p2_1f1b_save"])
def test_llama_layouts_match_single_process(runs, name):
    reference = runs["reference"]
    assert reference.losses[0] > reference.losses[-1]  # it trains
    got = runs[name]
    assert [r["iteration"] for r in got.records] == [1, 2, 3]
    assert_same_run(got, reference, RTOL)
    if name in SHORT:
        assert_equivalent(got, runs["reference3"], RTOL)


def test_llama_checkpoint_reshards_t2p2_to_t1p4v2(runs):
    """Saved at (t, p) = (2, 2) after iteration 3, resumed at t=1, p=4, v=2: iterations 4-6 as if uninterrupted."""
    resumed = runs["t1p4v2_resume"]
    assert [r["iteration"] for r in resumed.records] == [4, 5, 6]
    assert_equivalent(resumed, runs["reference"], RTOL)


def test_gqa_groups_must_split_over_tensor_parallel(capsys):
    """t must divide G: one line naming the flag, exit 2, before any process starts."""
    code = main(["train", "--model", "tiny-llama", "--tensor-model-parallel-size", "4", "--nproc-per-node", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4" in err[0]


def test_explicit_flags_override_the_preset():
    args = build_parser().parse_args(["train", "--model", "llama3-8b", "--num-layers", "2",
                                      "--layernorm-epsilon", "1e-6"])
    m = config_from_args(args).model
    assert (m.num_layers, m.hidden_size, m.num_query_groups, m.norm_epsilon) == (2, 4096, 8, 1e-6)
    assert m.swiglu and m.untie_embeddings_and_output_weights and m.disable_bias_linear
    assert m.rotary_base == 500000.0 and m.position_embedding_type == "rope"


def test_loading_a_llama_checkpoint_into_gpt2_flags_names_the_flags():
    from ptdp.checkpointing.validation import model_mismatch, model_shape
    from ptdp.config import ModelConfig
    from ptdp.config.presets import MODEL_PRESETS

    llama = ModelConfig(**MODEL_PRESETS["tiny-llama"])
    gpt = ModelConfig(**{k: v for k, v in MODEL_PRESETS["tiny-llama"].items()
                         if k in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length")})
    problem = model_mismatch(model_shape(llama, 257, 384), gpt, None, 1)
    assert problem is not None and "--swiglu True there, False here" in problem and "--normalization" in problem
    assert model_mismatch(model_shape(llama, 257, 384), llama, None, 1) is None
