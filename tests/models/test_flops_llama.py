"""FLOPs, parameters and the planner for Llama-family models, against values derived by hand from
docs/references.md, §Llama-family layers (and against the real model's parameter count)."""

from __future__ import annotations

import torch

from ptdp.config import ModelConfig
from ptdp.models import GPTModel
from ptdp.models.flops import architecture, flops_per_iteration, layer_forward_flops, model_parameter_count
from ptdp.planner import ParallelConfig
from ptdp.planner.command import add_plan_arguments, run_plan
from ptdp.planner.memory import activation_bytes_per_layer, layer_parameters_per_rank
from ptdp.planner.spec import MODEL_PRESETS, GPTSpec

# l=2, h=8, a=4 heads of d=2, G=2 groups, ffn=12, s=4, V=10; SwiGLU, RMSNorm, RoPE, untied, no biases
CFG = ModelConfig(num_layers=2, hidden_size=8, num_attention_heads=4, group_query_attention=True,
                  num_query_groups=2, ffn_hidden_size=12, seq_length=4, vocab_size=10, swiglu=True,
                  normalization="RMSNorm", position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                  disable_bias_linear=True, make_vocab_size_divisible_by=1)
B = 3  # global batch: 12 tokens


def test_llama_layer_flops_by_hand():
    # per token: projections 2h(2q + 2k) = 2·8·(16 + 8) = 384 (= 2h(2h + 2h·G/a)), scores and values
    # 4·s·q = 128, SwiGLU 6·h·ffn = 576: 1088 per token, 12 tokens
    assert layer_forward_flops(8, 4, 12, 12, **architecture(CFG)) == 12 * 1088 == 13056
    # the GPT-2 special case is unchanged: 24·B·s·h² + 4·B·s²·h with ffn = 4h
    assert layer_forward_flops(8, 4, 12) == 24 * 12 * 64 + 4 * 12 * 4 * 8


def test_llama_iteration_flops_by_hand():
    logits = 3 * 2 * 12 * 8 * 10  # 6·B·s·h·V, untied or not
    kw = architecture(CFG)
    assert flops_per_iteration(2, 8, 4, 10, B, recompute=False, ffn_hidden_size=12, **kw) == 3 * 2 * 13056 + logits
    assert flops_per_iteration(2, 8, 4, 10, B, recompute=True, ffn_hidden_size=12, **kw) == 4 * 2 * 13056 + logits


def test_llama_parameter_count_by_hand_and_against_the_model():
    # per layer: attention h(2q + 2k) = 192, SwiGLU 3·h·ffn = 288, two RMSNorms 2h = 16, no biases: 496;
    # embedding and untied output 2·V·h = 160, no position table
    assert model_parameter_count(CFG) == 2 * 496 + 160 == 1152
    with torch.device("meta"):
        model = GPTModel(CFG, 10, 10)
    assert sum(p.numel() for p in model.parameters()) == 1152 + 8  # + the final RMSNorm, which P omits


def test_published_llama_sizes():
    """Meta's reported totals (final norm included): 6,738,415,616 / 8,030,261,248 / 70,553,706,496."""
    for name, total in (("llama2-7b", 6_738_415_616), ("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496)):
        spec = MODEL_PRESETS[name]
        assert model_parameter_count(spec) + spec.hidden_size == total, name


def test_llama_memory_model_by_hand():
    spec = GPTSpec(num_layers=2, hidden_size=8, num_attention_heads=4, seq_length=4, vocab_size=10,
                   ffn_hidden_size=12, num_query_groups=2, swiglu=True, untie_embeddings_and_output_weights=True,
                   normalization="RMSNorm", position_embedding_type="rope", disable_bias_linear=True)
    # t = 2: everything but the two RMSNorms (16, replicated) is split
    assert layer_parameters_per_rank(spec, 2) == (496 - 16) / 2 + 16
    # activations, b = 1, t = 2: 10·s·b·h replicated + s·b·(4q + 4k + 8·ffn)/t + 5·a·s²·b/t
    cfg = ParallelConfig(2, 1, 1)
    expected = 10 * 4 * 8 + 4 * (4 * 8 + 4 * 4 + 8 * 12) / 2 + 5 * 4 * 16 / 2
    assert activation_bytes_per_layer(spec, cfg) == expected


def _plan(capsys, *argv: str) -> tuple[int, str, str]:
    import argparse

    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    code = run_plan(parser.parse_args(list(argv)))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_llama3_70b_answers_with_reasoning(capsys):
    code, out, _ = _plan(capsys, "--model", "llama3-70b", "--gpus", "512", "--gpu", "h100-80gb")
    assert code == 0
    assert "70.6B parameters" in out and "G=8" in out and "why:" in out
    best = next(line for line in out.splitlines() if line.startswith("best"))
    t = int(best.split()[1])
    assert 8 % t == 0  # t divides the 8 key/value groups
    assert "takeaway 1" in out and "bubble (p-1)/(v·m)" in out


def test_plan_refuses_t_that_splits_a_kv_group(capsys):
    code, _, err = _plan(capsys, "--model", "llama3-70b", "--gpus", "512", "--tensor-model-parallel-size", "16",
                         "--pipeline-model-parallel-size", "4")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--num-query-groups 8" in err
