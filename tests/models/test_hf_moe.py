"""Hugging Face Mixtral and Qwen2-MoE round trips: small random models built locally (no hub)
import into ptdp checkpoints that compute HF's logits (from either expert layout: per-expert files, or the
fused in-memory tensors of transformers 5), train one AdamW step to HF's loss, export back to files that
transformers loads, and decode greedily to the same tokens."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    assert_export_equals_hf_files,
    assert_one_adamw_step_alike,
    assert_reload_equals_hf,
    hf_import,
)

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


V = 300
COMMON = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, initializer_range=0.1, bos_token_id=None, eos_token_id=None,
              pad_token_id=None, num_experts_per_tok=2)


def hf_model(tmp_path, kind: str, fused_files: bool = False):
    torch.manual_seed(0)
    if kind == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=32, num_local_experts=4, **COMMON)
        model = transformers.MixtralForCausalLM(config)
    else:  # shared expert with its gate, the second layer dense, no top-k renormalisation
        config = transformers.Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=32, num_experts=4,
                                             shared_expert_intermediate_size=40, mlp_only_layers=[1],
                                             norm_topk_prob=False, **COMMON)
        model = transformers.Qwen2MoeForCausalLM(config)
    model.eval()
    directory = tmp_path / f"hf-{kind}"
    model.save_pretrained(str(directory), safe_serialization=True)  # per-expert tensors on disk
    if fused_files:  # transformers 5's in-memory layout: experts.gate_up_proj / experts.down_proj
        safetensors_torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                                    str(directory / "model.safetensors"))
    return model, directory


TOKENS = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))


def test_mixtral_logits_both_layouts_one_adamw_step_export_and_generation(tmp_path):
    hf, directory = hf_model(tmp_path, "mixtral")
    ours, tensors, _ = hf_import(tmp_path, directory)
    assert ours.layers["0"].mlp.experts.fc1_weight.shape == (4, 2, 32, 64)
    with torch.no_grad():
        expected = hf(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS)[..., :V], expected, rtol=0, atol=1e-5)
    _, fused_dir = hf_model(tmp_path / "fused", "mixtral", fused_files=True)
    _, fused_tensors, _ = hf_import(tmp_path, fused_dir, "ckpt-fused")
    assert fused_tensors.keys() == tensors.keys()
    for name, value in tensors.items():
        assert torch.equal(fused_tensors[name], value), name

    saved = assert_export_equals_hf_files(tmp_path / "ckpt", tmp_path / "out", directory)
    assert saved["model_type"] == "mixtral"
    assert_reload_equals_hf(tmp_path / "out", TOKENS, expected, atol=1e-6, ours=ours)

    assert_one_adamw_step_alike(hf, ours, TOKENS, V)


def test_qwen2_moe_shared_expert_logits_and_export(tmp_path):
    hf, directory = hf_model(tmp_path, "qwen2_moe")
    ours, _, _ = hf_import(tmp_path, directory)
    assert ours.layers["0"].mlp.shared_expert_gate is not None and not hasattr(ours.layers["1"].mlp, "router")
    assert ours.layers["0"].mlp.router.pre_softmax and ours.layers["0"].attention.qkv.bias is not None
    with torch.no_grad():
        expected = hf(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS)[..., :V], expected, rtol=0, atol=1e-5)
    _, fused_dir = hf_model(tmp_path / "fused", "qwen2_moe", fused_files=True)
    fused, _, _ = hf_import(tmp_path, fused_dir, "ckpt-fused")
    with torch.no_grad():
        torch.testing.assert_close(fused(TOKENS)[..., :V], expected, rtol=0, atol=1e-5)
    assert_export_equals_hf_files(tmp_path / "ckpt", tmp_path / "out", directory)
    reloaded = assert_reload_equals_hf(tmp_path / "out", TOKENS, expected, atol=1e-6)
    assert type(reloaded).__name__ == "Qwen2MoeForCausalLM"
