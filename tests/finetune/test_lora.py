"""LoRA fine-tuning (``--lora-rank``, ptdp/parallel/lora.py, docs/lora.md) of a random Hugging Face Llama
(grouped-query attention) imported here: started from the base with ``--pretrained-checkpoint``, trained in
one process and in layouts -- t = 2 with and without sequence parallelism, p = 2 under 1F1B, interleaved,
ZBV (its weight gradients deferred to W passes) and DualPipeV (overlapped pairs), ZeRO-1 and ZeRO-3 over
d = 2, c = 2 -- each equal to one process per iteration (loss, gradient norm) and in the final adapters; the base weights come out of every layout
exactly as they went in, and only the adapters have optimizer state; ZeRO-3 shards the frozen weights too
(model states about half ZeRO-1's at d = 2). A resumed run continues exactly, also under ZeRO-3. The
PEFT export loaded by ``peft.PeftModel`` over the HF base gives ptdp's logits; the merged export holds
W + (alpha/r) B A and ``transformers`` gives ptdp's logits with it. The gradient buffers hold the adapters
alone."""

from __future__ import annotations

import json
import shlex

import pytest
import torch
from helpers import assert_same_run, assert_same_training, run_layouts

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from ptdp.checkpointing import read_full_model_state  # noqa: E402
from ptdp.hf.convert import export_hf, full_model_from_state, import_hf_model, train_flags  # noqa: E402
from ptdp.parallel.lora import is_adapter  # noqa: E402

V, S, R, ALPHA = 300, 32, 8, 16.0
TRAIN = ["--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-2", "--lr-warmup-iters", "0",
         "--lr-decay-style", "constant", "--weight-decay", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--seq-length", str(S), "--log-interval", "1", "--lora-rank", str(R), "--lora-alpha", str(ALPHA)]
P2 = ["--pipeline-model-parallel-size", "2"]
LAYOUTS = {
    "t2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "t2": (2, ["--tensor-model-parallel-size", "2"]),
    "p2-1f1b": (2, P2),
    "p2-zbv": (2, [*P2, "--pipeline-schedule", "zbv"]),
    "p2-interleaved": (2, [*P2, "--virtual-pipeline-model-parallel-size", "2", "--pipeline-schedule", "interleaved"]),
    "p2-dualpipev": (2, [*P2, "--pipeline-schedule", "dualpipev"]),
    "zero1-d2": (2, ["--use-distributed-optimizer"]),
    "zero3-d2": (2, ["--data-parallel-sharding-strategy", "optim_grads_params"]),
    "c2": (2, ["--context-parallel-size", "2"]),
}


def hf_llama(directory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=64, initializer_range=0.1, tie_word_embeddings=False,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(config).float().eval()
    model.save_pretrained(str(directory), safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    hf = hf_llama(tmp / "hf")
    _, cfg, moe = import_hf_model(tmp / "hf", tmp / "base")
    base = [*shlex.split(train_flags(cfg, moe)), "--vocab-size", str(V), *TRAIN,
            "--pretrained-checkpoint", str(tmp / "base")]
    plan = {"one": (1, ["--train-iters", "3"])}
    plan.update({name: (world, ["--train-iters", "3", *flags]) for name, (world, flags) in LAYOUTS.items()})
    # resumed: two iterations saved, then the third after a restart (--load wins over --pretrained-checkpoint)
    plan["first-two"] = (1, ["--train-iters", "2", "--save", str(tmp / "resume")])
    plan["resumed"] = (1, ["--train-iters", "3", "--load", str(tmp / "resume"), "--save", str(tmp / "resume")])
    zero3 = LAYOUTS["zero3-d2"][1]  # and under ZeRO-3, whose shards of the frozen weights are saved and loaded
    plan["zero3-first-two"] = (2, [*zero3, "--train-iters", "2", "--save", str(tmp / "resume3")])
    plan["zero3-resumed"] = (2, [*zero3, "--train-iters", "3", "--load", str(tmp / "resume3"), "--save",
                                 str(tmp / "resume3")])
    runs = run_layouts(tmp, plan, base=base)
    return tmp, hf, runs


def _adapters(weights: dict) -> dict:
    return {name: t for name, t in weights.items() if is_adapter(name)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_trains_the_adapters_as_one_process(trained, layout):
    tmp, _, runs = trained
    one, got = runs["one"], runs[layout]
    assert_same_run(got, one)
    assert_same_training(_adapters(got.weights), _adapters(one.weights), _adapters(one.initial))
    base, _ = read_full_model_state(tmp / "base")
    frozen = {name: t for name, t in got.weights.items() if not is_adapter(name)}
    assert frozen.keys() == base.keys()
    for name, tensor in base.items():  # the base weights never move, in any layout
        assert torch.equal(frozen[name], tensor), name


def test_only_the_adapters_have_optimizer_state(trained):
    import torch.distributed.checkpoint as dcp

    from ptdp.checkpointing import storage

    tmp, _, runs = trained
    for name in ("one", "zero1-d2", "zero3-d2"):
        keys = dcp.FileSystemReader(storage.resolve(runs[name].ckpt)).read_metadata().state_dict_metadata
        optimizer = {k.removeprefix("optimizer.").rpartition(".")[0] for k in keys if k.startswith("optimizer.")}
        assert optimizer and all(is_adapter(n) for n in optimizer), (name, sorted(optimizer)[:4])
        adapters = {k.removeprefix("model.") for k in keys if k.startswith("model.") and is_adapter(k)}
        assert optimizer == adapters, name  # and every adapter has its state
    b = runs["one"].weights["layers.0.attention.qkv.adapter.lora_B"]
    assert b.abs().max() > 0  # trained: B left zero (the fresh adapter) would make the exports vacuous


def test_resumed_run_continues_exactly(trained):
    _, _, runs = trained
    assert [r["iteration"] for r in runs["resumed"].records] == [3]
    assert_same_run(runs["first-two"], runs["one"], rtol=0)
    assert_same_run(runs["resumed"], runs["one"], rtol=0)
    assert [r["iteration"] for r in runs["zero3-resumed"].records] == [3]
    assert_same_run(runs["zero3-resumed"], runs["zero3-d2"], rtol=0)


def test_zero3_shards_the_frozen_weights(trained):
    """ZeRO-3 keeps 1/d of the frozen base weights per rank (gathered per chunk, never reduced): its model
    states are about half ZeRO-1's at d = 2, where every rank keeps the base whole."""
    _, _, runs = trained
    zero1 = max(runs["zero1-d2"].records[-1]["model_state_bytes_per_rank"])
    zero3 = max(runs["zero3-d2"].records[-1]["model_state_bytes_per_rank"])
    assert zero3 < 0.6 * zero1, (zero3, zero1)


def _ptdp_logits(ckpt, tokens):
    model = full_model_from_state(*read_full_model_state(ckpt))
    with torch.no_grad():
        return model(tokens)[..., :V]


def test_peft_adapter_gives_ptdp_logits(trained):
    tmp, hf, runs = trained
    export_hf(runs["one"].ckpt, tmp / "peft", fmt="peft")
    config = json.loads((tmp / "peft" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (R, ALPHA)
    tokens = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = hf(tokens).logits
        model = peft.PeftModel.from_pretrained(hf, str(tmp / "peft")).eval()
        got = model(tokens).logits
    expected = _ptdp_logits(runs["one"].ckpt, tokens)
    assert (expected - before).abs().max() > 1e-3  # the adapters change the model
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)


def test_merged_export_is_base_plus_scaled_BA_and_gives_ptdp_logits(trained):
    tmp, _, runs = trained
    export_hf(runs["one"].ckpt, tmp / "merged", merge_lora=True)
    tensors, _ = read_full_model_state(runs["one"].ckpt)
    from safetensors.torch import load_file

    merged = load_file(str(tmp / "merged" / "model.safetensors"))
    a, b = tensors["layers.1.mlp.fc2.adapter.lora_A"], tensors["layers.1.mlp.fc2.adapter.lora_B"]
    want = tensors["layers.1.mlp.fc2.weight"] + (ALPHA / R) * b @ a
    torch.testing.assert_close(merged["model.layers.1.mlp.down_proj.weight"], want, rtol=0, atol=1e-6)
    a, b = tensors["layers.0.mlp.fc1.adapter.lora_A"], tensors["layers.0.mlp.fc1.adapter.lora_B"]  # fused gate/up
    want = tensors["layers.0.mlp.fc1.weight"][1] + (ALPHA / R) * b[1] @ a
    torch.testing.assert_close(merged["model.layers.0.mlp.up_proj.weight"], want, rtol=0, atol=1e-6)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp / "merged")).eval()
    tokens = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, _ptdp_logits(runs["one"].ckpt, tokens), rtol=0, atol=2e-5)


def test_gradient_buffers_hold_the_adapters_alone():
    from ptdp.config import LoRAConfig, ModelConfig, MoEConfig
    from ptdp.models import GPTModel
    from ptdp.parallel.data.buffer import BucketLayout, FlatBuffer
    from ptdp.parallel.init import init_parameters
    from ptdp.parallel.lora import apply_lora
    from ptdp.parallel.placement import Placements

    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, hidden_dropout=0.0,
                      attention_dropout=0.0)
    model = GPTModel(cfg, 64, 128, MoEConfig())
    placements = Placements()
    placements.adopt(model)
    apply_lora(model, LoRAConfig(lora_rank=4, lora_target_modules=["linear_qkv", "linear_fc2"]), placements)
    init_parameters(model, 1, 0.02, 2, placements)
    adapters = [p for n, p in model.named_parameters() if is_adapter(n)]
    assert len(adapters) == 2 * 2 * 2 and all(p.requires_grad for p in adapters)
    assert not any(p.requires_grad for n, p in model.named_parameters() if not is_adapter(n))
    buffer = FlatBuffer(model.parameters(), BucketLayout(1 << 20, placements=placements))
    assert set(buffer.params) == set(adapters)
    assert sum(b.grad_data.numel() for b in buffer.buckets) == sum(p.numel() for p in adapters)
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():  # a fresh adapter (B = 0, A drawn) leaves the model unchanged
        adapted = model(tokens)
        linears = [m for m in model.modules() if getattr(m, "adapter", None) is not None]
        assert all(m.adapter.lora_B.abs().max() == 0 < m.adapter.lora_A.abs().max() for m in linears)
        for m in linears:
            m.adapter = None
        torch.testing.assert_close(model(tokens), adapted, rtol=0, atol=0)


def test_moe_expert_parallel_trains_the_adapters_as_one_process(tmp_path):
    """A GPT MoE model, its experts adapted too (``linear_fc1``/``linear_fc2``: one adapter per expert, split by
    experts like the weights), with e = 2 against one process; the experts' adapters merge per expert."""
    from helpers import TINY

    from ptdp.parallel.lora import merge_lora

    flags = ["--num-experts", "4", "--moe-router-topk", "2", "--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2"]
    e2 = [*flags, "--expert-model-parallel-size", "2"]
    runs = run_layouts(tmp_path, {"one": (1, flags), "e2": (2, e2),  # ZeRO-3: the dense part's frozen weights sharded
                                  "e2-zero3": (2, [*e2, "--data-parallel-sharding-strategy", "optim_grads_params"])},
                       base=[*TINY, "--num-layers", "2"])
    one = _adapters(runs["one"].weights)
    for name in ("e2", "e2-zero3"):
        assert_same_run(runs[name], runs["one"])
        assert_same_training(_adapters(runs[name].weights), one, _adapters(runs["one"].initial))
    base = {k: v for k, v in runs["one"].weights.items() if not is_adapter(k)}
    assert all(torch.equal(runs["e2-zero3"].weights[k], v) for k, v in base.items())
    a, b = one["layers.1.mlp.experts.fc2_adapter.lora_A"], one["layers.1.mlp.experts.fc2_adapter.lora_B"]
    assert a.shape == (4, 4, 128) and b.shape == (4, 32, 4) and b.abs().max() > 0
    merged = merge_lora(runs["one"].weights, 8 / 4)
    weight = runs["one"].weights["layers.1.mlp.experts.fc2_weight"]
    for e in range(4):
        torch.testing.assert_close(merged["layers.1.mlp.experts.fc2_weight"][e], weight[e] + 2.0 * b[e] @ a[e])


def test_refusals_name_the_flag(trained):
    from ptdp.config import Config, ConfigError, validate

    config = Config()
    config.lora.lora_rank, config.lora.lora_target_modules = 4, ["linear_qkv", "experts"]
    config.moe.num_experts, config.parallel.tensor_model_parallel_size = 4, 2
    errors = validate(config, 2)
    assert any(e.startswith("--lora-target-modules: experts is not one of") for e in errors), errors
    config.lora.lora_target_modules = ["linear_fc1"]
    assert any("expert tensor parallelism" in e for e in validate(config, 2))
    config.lora.lora_rank, config.lora.lora_dropout = 0, 0.1
    assert "--lora-dropout and --lora-target-modules apply only with --lora-rank R > 0" in validate(config, 2)
    tmp, _, runs = trained
    with pytest.raises(ConfigError, match="holds LoRA adapters; pass --merge-lora"):
        export_hf(runs["one"].ckpt, tmp / "refused")
    with pytest.raises(ConfigError, match="holds no LoRA adapters"):
        export_hf(tmp / "base", tmp / "refused", merge_lora=True)
