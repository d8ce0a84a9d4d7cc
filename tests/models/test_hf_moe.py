"""Hugging Face Mixtral and Qwen2-MoE round trips: small random models built locally (no hub)
import into ptdp checkpoints that compute HF's logits (from either expert layout: per-expert files, or the
fused in-memory tensors of transformers 5), train one AdamW step to HF's loss, export back to files that
transformers loads, and decode greedily to the same tokens."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from ptdp.checkpointing import read_full_model_state  # noqa: E402
from ptdp.cli.generate import generate  # noqa: E402
from ptdp.hf.convert import export_hf, full_model_from_state, import_hf  # noqa: E402

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


def _ours(tmp_path, directory, name: str = "ckpt"):
    import_hf(directory, tmp_path / name)
    tensors, config = read_full_model_state(tmp_path / name)
    return full_model_from_state(tensors, config), tensors


def _loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1, :V].reshape(-1, V), tokens[:, 1:].reshape(-1))


TOKENS = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))


def test_mixtral_logits_both_layouts_one_adamw_step_export_and_generation(tmp_path):
    hf, directory = hf_model(tmp_path, "mixtral")
    ours, tensors = _ours(tmp_path, directory)
    assert ours.layers["0"].mlp.experts.fc1_weight.shape == (4, 2, 32, 64)
    with torch.no_grad():
        expected = hf(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS)[..., :V], expected, rtol=0, atol=1e-5)
    _, fused_dir = hf_model(tmp_path / "fused", "mixtral", fused_files=True)
    _, fused_tensors = _ours(tmp_path, fused_dir, "ckpt-fused")
    assert fused_tensors.keys() == tensors.keys()
    for name, value in tensors.items():
        assert torch.equal(fused_tensors[name], value), name

    export_hf(tmp_path / "ckpt", tmp_path / "out")
    original = safetensors_torch.load_file(str(directory / "model.safetensors"))
    exported = safetensors_torch.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "mixtral"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(TOKENS).logits, expected, rtol=0, atol=1e-6)
    prompt = [5, 17, 42, 99, 7]
    with torch.no_grad():
        hf_ids = reloaded.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, min_new_tokens=10)
    assert generate(ours, None, prompt, 10, greedy=True) == hf_ids[0, len(prompt):].tolist()

    # one AdamW step on each side (elementwise, so the layouts' rearrangements do not matter)
    ours.train()
    for model in (hf, ours):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        logits = model(TOKENS).logits if model is hf else model(TOKENS)
        _loss(logits, TOKENS).backward()
        optimizer.step()
    with torch.no_grad():
        after_hf, after_ours = _loss(hf(TOKENS).logits, TOKENS), _loss(ours(TOKENS), TOKENS)
    assert not torch.isclose(after_hf, _loss(expected, TOKENS))  # the step changed the model
    torch.testing.assert_close(after_ours, after_hf, rtol=1e-5, atol=1e-5)


def test_qwen2_moe_shared_expert_logits_and_export(tmp_path):
    hf, directory = hf_model(tmp_path, "qwen2_moe")
    ours, _ = _ours(tmp_path, directory)
    assert ours.layers["0"].mlp.shared_expert_gate is not None and not hasattr(ours.layers["1"].mlp, "router")
    assert ours.layers["0"].mlp.router.pre_softmax and ours.layers["0"].attention.qkv.bias is not None
    with torch.no_grad():
        expected = hf(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS)[..., :V], expected, rtol=0, atol=1e-5)
    _, fused_dir = hf_model(tmp_path / "fused", "qwen2_moe", fused_files=True)
    fused, _ = _ours(tmp_path, fused_dir, "ckpt-fused")
    with torch.no_grad():
        torch.testing.assert_close(fused(TOKENS)[..., :V], expected, rtol=0, atol=1e-5)
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    original = safetensors_torch.load_file(str(directory / "model.safetensors"))
    exported = safetensors_torch.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert type(reloaded).__name__ == "Qwen2MoeForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(reloaded(TOKENS).logits, expected, rtol=0, atol=1e-6)
