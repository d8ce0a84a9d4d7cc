"""Hugging Face DeepSeek-V3 round trips: a small random ``DeepseekV3ForCausalLM`` built locally (no
hub) -- multi-latent attention with a query compression, the sigmoid router with a non-zero expert bias and
groups, a shared expert, a first dense layer -- imports into a ptdp checkpoint that computes HF's logits,
trains one AdamW step to HF's loss and decodes greedily to HF's tokens; the export loads back in transformers
bit for bit. YaRN and a model without the query compression give HF's logits too, and a model with MTP
modules round-trips through HF's files."""

from __future__ import annotations

import json

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
if not hasattr(transformers, "DeepseekV3ForCausalLM"):
    pytest.skip("this transformers has no DeepseekV3ForCausalLM", allow_module_level=True)

from ptdp.checkpointing import write_full_model_state  # noqa: E402
from ptdp.hf.convert import export_hf  # noqa: E402

V = 300
SHAPE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=12,
             routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, v_head_dim=8,
             qk_nope_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1,
             max_position_embeddings=64, initializer_range=0.1, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
TOKENS = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))


def hf_model(directory, **overrides):
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**SHAPE, **overrides})).eval()
    with torch.no_grad():  # a bias that changes the routing (HF starts it at zero)
        for layer in model.model.layers[SHAPE["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
    model.save_pretrained(str(directory), safe_serialization=True)  # per-expert tensors on disk
    return model


def test_deepseek_v3_logits_adamw_step_generation_and_export(tmp_path):
    hf = hf_model(tmp_path / "hf")
    model, tensors, config = hf_import(tmp_path, tmp_path / "hf")
    assert config["model"]["multi_latent_attention"] and config["moe"]["moe_layer_freq"] == "([0]*1+[1]*1)"
    bias = tensors["layers.1.mlp.router.expert_bias"]
    assert torch.equal(bias, hf.model.layers[1].mlp.gate.e_score_correction_bias) and bias.abs().sum() > 0
    with torch.no_grad():
        expected = hf(TOKENS).logits
        torch.testing.assert_close(model(TOKENS)[..., :V], expected, rtol=0, atol=1e-5)
        # the bias decides the routing here: without it the logits are others
        model.layers["1"].mlp.router.expert_bias.zero_()
        assert not torch.allclose(model(TOKENS)[..., :V], expected, atol=1e-3)
        model.layers["1"].mlp.router.expert_bias.copy_(bias)

    saved = assert_export_equals_hf_files(tmp_path / "ckpt", tmp_path / "out", tmp_path / "hf")
    assert saved["model_type"] == "deepseek_v3"
    reloaded = assert_reload_equals_hf(tmp_path / "out", TOKENS, expected, ours=model)
    assert type(reloaded).__name__ == "DeepseekV3ForCausalLM"

    # one AdamW step on each side; the router weights train, the expert bias does not (a buffer)
    assert_one_adamw_step_alike(hf, model, TOKENS, V)


@pytest.mark.parametrize("overrides", [
    {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                         "mscale": 0.8, "mscale_all_dim": 0.9, "beta_fast": 8, "beta_slow": 2}},
    {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 8.0,
                         "original_max_position_embeddings": 8}},  # HF's table scale then is mscale(factor)
    {"q_lora_rank": None, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 0},
], ids=["yarn-mscale", "yarn-default-mscale", "no-q-compression-no-groups-all-moe"])
def test_deepseek_v3_variants_give_hf_logits_and_export(tmp_path, overrides):
    hf = hf_model(tmp_path / "hf", **overrides)
    model, _, config = hf_import(tmp_path, tmp_path / "hf")
    with torch.no_grad():
        expected = hf(TOKENS).logits
        torch.testing.assert_close(model(TOKENS)[..., :V], expected, rtol=0, atol=1e-5)
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    assert_reload_equals_hf(tmp_path / "out", TOKENS, expected, atol=1e-6)


def test_mtp_modules_round_trip_through_hf_files(tmp_path):
    """A ptdp model with two MTP modules exports them as DeepSeek's extra layers (transformers ignores them)
    and imports them back unchanged."""
    hf_model(tmp_path / "hf")
    _, tensors, config = hf_import(tmp_path, tmp_path / "hf")
    config["model"]["mtp_num_layers"] = 2
    torch.manual_seed(3)
    from ptdp.hf.convert import model_config_from_dict, moe_config_from_dict
    from ptdp.models import GPTModel

    full = GPTModel(model_config_from_dict(config), V, tensors["embedding.word_embeddings.weight"].shape[0],
                    moe_config_from_dict(config))
    state = {k: tensors.get(k, torch.randn(v.shape) * 0.1) for k, v in full.state_dict().items()}
    write_full_model_state(tmp_path / "mtp", state, config)
    export_hf(tmp_path / "mtp", tmp_path / "out")
    exported = safetensors_torch.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "model.layers.3.eh_proj.weight" in exported and "model.layers.2.shared_head.head.weight" in exported
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 2
    _, back, back_config = hf_import(tmp_path, tmp_path / "out", "back")
    assert back_config["model"]["mtp_num_layers"] == 2
    assert back.keys() == state.keys()
    for name, value in state.items():
        assert torch.equal(back[name], value), name


def test_refuses_what_ptdp_does_not_compute_with_one_line(tmp_path):
    from helpers import run_ptdp

    hf_model(tmp_path / "hf", rope_interleave=False)
    proc = run_ptdp(["import", "--in", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "rope_interleave" in proc.stderr
