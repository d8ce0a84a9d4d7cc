"""Qwen3 and Qwen3-MoE (and a Llama of 4,096 positions trained at 32), imported from random Hugging Face models
built here (no hub), trained by ``ptdp train`` in one process and in composed layouts -- t = 2 with and
without sequence parallelism, with p = 2; c = 2 with ZeRO-3; interleaved p = 2 with full recomputation; ZBV
with vocabulary parallelism; DualPipeV (with t = 2 for the dense model); (t, e) = (2, 2) folded for the MoE;
GPipe with ZeRO-1, ZB-H1 and V-Min for the dense model, 1F1B with ZeRO-2, ZB-H2 and V-Half for the MoE
-- each equal, per iteration (loss and gradient norm), to ``transformers`` + ``torch.optim.AdamW`` trained
on the same batches; the one-process run's final weights equal HF's; export loads back in ``transformers``
bit for bit; the importer's printed command runs as printed; a per-head q/k norm's gradient is summed over
the tensor-parallel heads (and is wrong without its sharding rule)."""

from __future__ import annotations

import json
import shlex

import pytest
import torch
from helpers import (
    assert_export_equals_hf_files,
    assert_reload_equals_hf,
    hf_family_tests,
    pooled_spawn,
    run_ptdp,
)

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from ptdp.checkpointing import read_full_model_state  # noqa: E402
from ptdp.cli.main import main  # noqa: E402
from ptdp.hf.convert import full_model_from_state, import_hf_model  # noqa: E402

V, S = 300, 32
COMMON = dict(vocab_size=V, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=24, max_position_embeddings=4096, initializer_range=0.1, rms_norm_eps=1e-6,
              tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
P2 = ["--pipeline-model-parallel-size", "2"]
T2_SP_P2 = (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", *P2])
C2_ZERO3 = (4, ["--context-parallel-size", "2", "--data-parallel-sharding-strategy", "optim_grads_params"])
INTERLEAVED_RECOMPUTE = (2, [*P2, "--virtual-pipeline-model-parallel-size", "2", "--pipeline-schedule", "interleaved",
                             "--recompute-granularity", "full", "--recompute-method", "uniform"])
LAYOUTS = {
    "dense": {"t2": (2, ["--tensor-model-parallel-size", "2"]),  # per-head norms split without SP too
              "t2-sp-p2": T2_SP_P2, "c2-zero3": C2_ZERO3, "p2-interleaved-recompute": INTERLEAVED_RECOMPUTE,
              "p2-zbv-vocab": (2, [*P2, "--pipeline-schedule", "zbv", "--enable-vocab-parallel"]),
              "p2-dualpipev-t2": (4, [*P2, "--pipeline-schedule", "dualpipev", "--tensor-model-parallel-size", "2"]),
              # the other schedules and ZeRO stages, each on one of the two models (the pair costs twice)
              "p2-gpipe-d2-zero1": (4, [*P2, "--pipeline-schedule", "gpipe", "--use-distributed-optimizer"]),
              "p2-zbh1": (2, [*P2, "--pipeline-schedule", "zb-h1"]),
              "p2-vmin": (2, [*P2, "--pipeline-schedule", "v-min"])},
    "moe": {"t2-sp-p2": T2_SP_P2, "c2-zero3": C2_ZERO3, "p2-interleaved-recompute": INTERLEAVED_RECOMPUTE,
            "t2-e2-folded": (2, ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                                 "--expert-tensor-parallel-size", "1", "--sequence-parallel"]),
            "p2-dualpipev": (2, [*P2, "--pipeline-schedule", "dualpipev"]),
            "p2-1f1b-d2-zero2": (4, [*P2, "--pipeline-schedule", "1f1b",
                                     "--data-parallel-sharding-strategy", "optim_grads"]),
            "p2-zbh2": (2, [*P2, "--pipeline-schedule", "zb-h2"]),
            "p2-vhalf": (2, [*P2, "--pipeline-schedule", "v-half"])},
}


def hf_model(directory, kind: str):
    torch.manual_seed(0)
    if kind == "dense":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(intermediate_size=96, **COMMON))
    elif kind == "llama":  # 4,096 positions, trained at --seq-length 32
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=96, **COMMON))
    else:  # the second layer dense, the top-k weights renormalised
        config = transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                             num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=True,
                                             **COMMON)
        model = transformers.Qwen3MoeForCausalLM(config)
    model.float().eval()
    model.save_pretrained(str(directory), safe_serialization=True)
    return model


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_import_gives_hf_logits_and_export_loads_back_bit_for_bit(tmp_path, kind):
    hf = hf_model(tmp_path / "hf", kind)
    _, cfg, moe = import_hf_model(tmp_path / "hf", tmp_path / "ckpt")
    assert cfg.qk_layernorm and cfg.kv_channels == 24 and cfg.max_position_embeddings == 4096
    assert (moe.num_experts, moe.moe_layer_freq, moe.moe_router_pre_softmax) == ((4, "[1,0,1,1]", False) if kind == "moe"
                                                                                  else (None, "1", False))
    ours = full_model_from_state(*read_full_model_state(tmp_path / "ckpt"))
    tokens = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        torch.testing.assert_close(ours(tokens)[..., :V], expected, rtol=0, atol=1e-5)

    saved = assert_export_equals_hf_files(tmp_path / "ckpt", tmp_path / "out", tmp_path / "hf")
    assert saved["model_type"] == ("qwen3" if kind == "dense" else "qwen3_moe")
    assert saved["head_dim"] == 24 and saved["max_position_embeddings"] == 4096
    assert_reload_equals_hf(tmp_path / "out", tokens, expected)


(trained, test_one_process_equals_hf_and_adamw_per_iteration_and_in_its_weights,
 test_layout_equals_hf_and_adamw_per_iteration) = hf_family_tests("qwen3", hf_model, LAYOUTS, V, S,
                                                                  kinds=["dense", "moe", "llama"])


def test_the_import_command_prints_a_train_command_that_runs_as_printed(tmp_path, capsys):
    hf_model(tmp_path / "hf", "dense")
    capsys.readouterr()
    assert main(["import", "--format", "hf", "--in", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    command = shlex.split(printed.split("continue training with: ", 1)[1])
    assert command[:2] == ["ptdp", "train"] and "--max-position-embeddings" in command and "--qk-layernorm" in command
    out = run_ptdp(["train", *command[2:], "--train-iters", "1", "--micro-batch-size", "1", "--global-batch-size", "1",
                    "--seq-length", "16"]).stdout
    assert f"loaded the model of {tmp_path / 'ckpt'}" in out and "starting from scratch" not in out


def _qk_norm_grads(rank: int, world_size: int, out: str) -> None:
    """t = 2 without sequence parallelism: the per-head q/k norms' gradients after the post-backward sum equal
    one process's; with their sharding rule removed each rank keeps the sum over its own heads only."""
    import torch.distributed as dist

    from ptdp.config import ModelConfig
    from ptdp.models import GPTModel
    from ptdp.models.sharding import ShardingRules
    from ptdp.parallel.init import init_parameters
    from ptdp.parallel.parallelize import parallelize
    from ptdp.parallel.placement import Placements
    from ptdp.parallel.sequence.grads import all_reduce_tp_partial_grads
    from ptdp.parallel.tensor import language_model_loss
    from ptdp.parallel.tensor.random import model_parallel_seed

    class WithoutHeadRules(GPTModel):  # the obvious way to add a q/k norm, and the trap
        def sharding_rules(self) -> ShardingRules:
            rules = super().sharding_rules().rules
            return ShardingRules(tuple((p, r) for p, r in rules if not p.endswith(("q_layernorm", "k_layernorm"))))

    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, hidden_dropout=0.0,
                      attention_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                      group_query_attention=True, num_query_groups=2, disable_bias_linear=True, qk_layernorm=True)
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    grads = {}
    for name, model_class, group in (("full", GPTModel, None), ("t2", GPTModel, dist.group.WORLD),
                                     ("t2-no-rule", WithoutHeadRules, dist.group.WORLD)):
        placements = Placements()
        model = parallelize(model_class(cfg, 50, 64), placements, tp_group=group)
        init_parameters(model, seed=3, std=0.02, num_layers=cfg.num_layers, placements=placements)
        with torch.no_grad():  # norms away from 1, so that their gradients matter
            for n, p in model.named_parameters():
                if "q_layernorm" in n or "k_layernorm" in n:
                    p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(n)))
        model_parallel_seed(1, rank if group else 0, 0, torch.device("cpu"))
        language_model_loss(model(tokens[:, :-1]), tokens[:, 1:], group).backward()
        if group is not None:
            all_reduce_tp_partial_grads(model.parameters(), group, placements)
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters() if "layernorm" in n}
    assert len(grads["full"]) == 2 * 4 + 1
    for n, g in grads["full"].items():
        torch.testing.assert_close(grads["t2"][n], g, rtol=1e-5, atol=1e-7, msg=n)
    broken = [n for n, g in grads["full"].items() if not torch.allclose(grads["t2-no-rule"][n], g, rtol=1e-3)]
    assert sorted(broken) == sorted(n for n in grads["full"] if "q_layernorm" in n or "k_layernorm" in n), broken
    torch.save(True, f"{out}.{rank}")


def test_per_head_qk_norm_gradients_are_summed_over_the_tensor_parallel_heads(tmp_path):
    pooled_spawn(_qk_norm_grads, 2, tmp_path, str(tmp_path / "ok"))
    assert all((tmp_path / f"ok.{r}").exists() for r in range(2))


@pytest.mark.parametrize("kind,change,fragment", [
    ("dense", {"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window=true"),
    ("dense", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types ['sliding_attention']"),
    ("dense", {"attention_bias": True}, "attention_bias=true"),
    ("moe", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ("moe", {"mlp_only_layers": [0, 1, 2, 3]}, "no MoE layer"),
])
def test_what_qwen3_cannot_compute_is_refused_at_import_in_one_line(tmp_path, capsys, kind, change, fragment):
    hf_model(tmp_path / "hf", kind)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config.update(change)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["import", "--format", "hf", "--in", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err
    assert not (tmp_path / "ckpt").exists()
