"""``ptdp train --load HF_DIR``: a Hugging Face directory (several safetensors shards) loads directly, each
rank reading only its slices, and trains bit for bit as ``ptdp import`` + ``--load CKPT`` does; a bad
directory stops before any worker with one line naming the file. ``ptdp export`` streams tensor by tensor
into HF's sharded layout, which transformers loads."""

from __future__ import annotations

import json
import shlex

import pytest
import torch
from helpers import run_layouts, run_ptdp

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from ptdp.checkpointing.hf_dir import open_hf_dir  # noqa: E402
from ptdp.checkpointing.hf_reader import HFStorageReader  # noqa: E402
from ptdp.hf.convert import import_hf_model, train_flags  # noqa: E402

VOCAB = 257  # the byte tokenizer of the default corpus
RUN = ["--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2",
       "--lr", "1e-3", "--lr-warmup-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
       "--log-interval", "1", "--vocab-size", str(VOCAB)]


def hf_model(directory, kind: str = "llama", fused: bool = False):
    """A random HF model saved in three or more shards (and its index); GQA with 8 query heads in 4 groups.
    Experts as ``save_pretrained`` writes them (per expert), or with ``fused`` as transformers 5 holds them
    (``save_original_format=False``: ``mlp.experts.gate_up_proj [E, 2f, h]``, ``mlp.experts.down_proj``)."""
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=64, initializer_range=0.1, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=8))
    elif kind == "qwen3_moe":  # 4 experts, top 2, renormalised
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True))
    elif kind == "mixtral":  # 4 experts, top 2
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2))
    elif kind == "gemma3":  # a sliding and a global layer, tied embeddings
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **{**common, "tie_word_embeddings": True}, head_dim=8, sliding_window=4, query_pre_attn_scalar=8,
            layer_types=["sliding_attention", "full_attention"]))
    elif kind == "gpt2":  # learned positions, Conv1D weights, tied embedding
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_inner=48, n_positions=64, initializer_range=0.1,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None))
    elif kind == "gpt_oss":  # sinks, biases everywhere, 4 experts with interleaved gate/up columns, h = f = 32
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
            **{**common, "intermediate_size": 32}, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=4, layer_types=["sliding_attention", "full_attention"], swiglu_limit=1.0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
    elif kind == "qwen3_next":  # a Gated DeltaNet layer (2 key heads), a gated attention layer, experts in the second
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
            **common, head_dim=8, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            mlp_only_layers=[0], norm_topk_prob=True))
    elif kind == "deepseek_v3":  # MLA, a dense layer then 4 sigmoid-routed experts in 2 groups, a shared expert
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **{**common, "num_attention_heads": 4, "num_key_value_heads": 4}, moe_intermediate_size=16,
            n_shared_experts=1, n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2,
            first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, v_head_dim=8,
            qk_nope_head_dim=8, rms_norm_eps=1e-6))
    else:  # Qwen2-MoE: 4 experts, top 2 without renormalising, a gated shared expert, QKV biases
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=24, norm_topk_prob=False, qkv_bias=True))
    with torch.no_grad():  # HF starts biases, sinks, DeepSeek's expert bias and Gemma's (1 + w) norms at zero:
        for name, param in model.named_parameters():  # random ones, so that a misplaced one shows
            if name.endswith((".bias", "_bias", "norm.weight", "sinks")) or ".ln_" in name:
                param.add_(torch.randn_like(param) * 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.3, 0.3)
    model.save_pretrained(str(directory), safe_serialization=True, max_shard_size="20KB",
                          save_original_format=not fused)
    assert len(list(directory.glob("model-*.safetensors"))) >= 3
    return model.eval()


def _rewrite_shards(directory, change) -> None:
    """Every shard's tensors through ``change(tensors) -> tensors``, the index following the new names."""
    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    weight_map = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors = change(safetensors_torch.load_file(str(directory / file)))
        safetensors_torch.save_file(tensors, str(directory / "rewritten.tmp"), metadata={"format": "pt"})
        (directory / "rewritten.tmp").replace(directory / file)
        weight_map.update(dict.fromkeys(tensors, file))
    index_file.write_text(json.dumps({**index, "weight_map": weight_map}))


def quantize_experts(directory) -> None:
    """A GPT-OSS directory with its experts as the published checkpoints hold them: MXFP4 blocks and scales
    (random codes, scales around 2^-4) in place of ``gate_up_proj``/``down_proj``."""
    def change(tensors):
        for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            e, rows_in, cols = tensors.pop(name).shape  # [E, in, out]: the blocks hold [E, out, in / 32, 16]
            g = torch.Generator().manual_seed(len(name) + cols)
            tensors[name + "_blocks"] = torch.randint(0, 256, (e, cols, rows_in // 32, 16), generator=g,
                                                      dtype=torch.uint8)
            tensors[name + "_scales"] = torch.randint(121, 126, (e, cols, rows_in // 32), generator=g,
                                                      dtype=torch.uint8)
        return tensors

    _rewrite_shards(directory, change)


def add_mtp_module(directory, layers: int = 2) -> None:
    """DeepSeek-V3's files with one MTP module at layer ``layers`` (``num_nextn_predict_layers`` 1): its
    transformer layer (the last layer's tensors, moved a little), its norms and projection, and the copies
    of the embedding and head DeepSeek's files repeat in it; in one more shard."""
    tensors = {}
    for file in directory.glob("model-*.safetensors"):
        tensors.update(safetensors_torch.load_file(str(file)))
    g = torch.Generator().manual_seed(5)
    last, mtp, h = f"model.layers.{layers - 1}.", f"model.layers.{layers}.", tensors["model.norm.weight"].shape[0]
    module = {mtp + n.removeprefix(last): v + 0.1 * torch.randn(v.shape, generator=g)
              for n, v in tensors.items() if n.startswith(last)}
    module.update({mtp + "enorm.weight": 1 + torch.randn(h, generator=g) * 0.3,
                   mtp + "hnorm.weight": 1 + torch.randn(h, generator=g) * 0.3,
                   mtp + "eh_proj.weight": torch.randn(h, 2 * h, generator=g) * 0.1,
                   mtp + "shared_head.norm.weight": 1 + torch.randn(h, generator=g) * 0.3,
                   mtp + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                   mtp + "shared_head.head.weight": tensors["lm_head.weight"].clone()})
    safetensors_torch.save_file(module, str(directory / "model-mtp.safetensors"), metadata={"format": "pt"})
    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"].update(dict.fromkeys(module, "model-mtp.safetensors"))
    index_file.write_text(json.dumps(index))
    config = json.loads((directory / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1


# (HF kind, layout) of the two-rank pairs: import + --load against --load HF_DIR
PAIRS = {"qwen2_moe-t2": ("qwen2_moe", ["--tensor-model-parallel-size", "2"]),
         "gemma3-t2": ("gemma3", ["--tensor-model-parallel-size", "2"]),
         "gpt2-t2": ("gpt2", ["--tensor-model-parallel-size", "2"]),
         "gpt_oss-t2-e2": ("gpt_oss", ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                                       "--expert-tensor-parallel-size", "1"]),  # its expert biases need etp = 1
         "gpt_oss-zero3": ("gpt_oss", ["--data-parallel-sharding-strategy", "optim_grads_params"]),
         "deepseek_v3-t2": ("deepseek_v3", ["--tensor-model-parallel-size", "2"]),
         "qwen3_next-t2-e2": ("qwen3_next", ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                                             "--expert-tensor-parallel-size", "1"]),
         "qwen3_next-zero3": ("qwen3_next", ["--data-parallel-sharding-strategy", "optim_grads_params"])}
FUSED = {"qwen3_next-t2-e2"}  # also --load from the fused directory: equal to the per-expert one


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An HF Llama directory, its import, and four runs: --load of each, at t = 4, and at p = 2 with d = 2
    under ZeRO-3 (the weights loaded as flat pieces, ``checkpointing/sharded.py``'s boxes); and for each of
    :data:`PAIRS` the same two runs (and for :data:`FUSED` a third, from the fused directory). GPT-OSS's
    directory holds its experts as MXFP4 blocks and scales, DeepSeek-V3's an MTP module. All in one pool of
    ranks."""
    tmp_path = tmp_path_factory.mktemp("hf_load")
    hf_model(tmp_path / "hf")
    _, cfg, moe = import_hf_model(tmp_path / "hf", tmp_path / "ckpt")
    shape = [*shlex.split(train_flags(cfg, moe)), *RUN]
    t4 = ["--tensor-model-parallel-size", "4"]  # pads 257 to 384 rows, as the import did
    z3 = ["--pipeline-model-parallel-size", "2", "--data-parallel-sharding-strategy", "optim_grads_params"]
    plan = {"import_t4": (4, [*shape, *t4, "--load", str(tmp_path / "ckpt")]),
            "direct_t4": (4, [*shape, *t4, "--load", str(tmp_path / "hf")]),
            "import_z3": (4, [*shape, *z3, "--load", str(tmp_path / "ckpt")]),
            "direct_z3": (4, [*shape, *z3, "--load", str(tmp_path / "hf")])}
    for kind in dict.fromkeys(k for k, _ in PAIRS.values()):
        hf_model(tmp_path / kind, kind)
        if kind == "gpt_oss":
            quantize_experts(tmp_path / kind)
        if kind == "deepseek_v3":
            add_mtp_module(tmp_path / kind)
        _, cfg, moe = import_hf_model(tmp_path / kind, tmp_path / f"{kind}-ckpt")
        assert kind != "deepseek_v3" or cfg.mtp_num_layers == 1
        flags = [*shlex.split(train_flags(cfg, moe)), *RUN]
        for name, (of, layout) in PAIRS.items():
            if of == kind:
                plan[f"import_{name}"] = (2, [*flags, *layout, "--load", str(tmp_path / f"{kind}-ckpt")])
                plan[f"direct_{name}"] = (2, [*flags, *layout, "--load", str(tmp_path / kind)])
                if name in FUSED:
                    hf_model(tmp_path / f"{kind}-fused", kind, fused=True)
                    plan[f"fused_{name}"] = (2, [*flags, *layout, "--load", str(tmp_path / f"{kind}-fused")])
    return tmp_path, run_layouts(tmp_path / "runs", plan, base=[])


def _assert_same_run(direct, imported, what) -> None:
    assert [(r["loss"], r["grad_norm"]) for r in direct.records] == \
        [(r["loss"], r["grad_norm"]) for r in imported.records] != [], what
    assert direct.weights.keys() == imported.weights.keys(), what
    for name, value in imported.weights.items():
        assert torch.equal(direct.weights[name], value), (what, name)


def test_load_hf_dir_at_t4_equals_import_then_load(trained):
    """Losses, gradient norms (every iteration) and the final weights: bit for bit, at t = 4 and at p = 2,
    d = 2 with ZeRO-3."""
    _, runs = trained
    for layout in ("t4", "z3"):
        _assert_same_run(runs[f"direct_{layout}"], runs[f"import_{layout}"], layout)


@pytest.mark.parametrize("name", list(PAIRS))
def test_hf_dir_on_two_ranks_equals_import_then_load(trained, name):
    """Qwen2-MoE at t = 2 (its QKV biases, shared expert and experts split by tensor rank); Gemma 3 at t = 2
    (its q/k and sandwich norms, the tied embedding); GPT-2 at t = 2 (columns of its transposed Conv1D weights); GPT-OSS from MXFP4 blocks at t = 2
    with e = 2 folded (its heads' sinks and QKV biases, two whole experts a rank) and under ZeRO-3 over d = 2
    (flat pieces cut through the interleaved gate/up rows); DeepSeek-V3 at t = 2 with its MTP module;
    Qwen3-Next at t = 2 with e = 2 folded (its heads' rows of ``q_proj``, its key heads' channels of
    ``conv1d``, two whole experts a rank) and under ZeRO-3 over d = 2: bit for bit as the import. For
    :data:`FUSED`, the fused directory loads bit for bit as the per-expert one."""
    _, runs = trained
    _assert_same_run(runs[f"direct_{name}"], runs[f"import_{name}"], name)
    if name in FUSED:
        _assert_same_run(runs[f"fused_{name}"], runs[f"direct_{name}"], f"{name} fused")


def test_streamed_export_of_a_t4_checkpoint_is_sharded_and_loads_in_transformers(trained, capsys):
    """The t = 4 run's checkpoint exports tensor by tensor into 20 KB shards with an index; the tensors are
    the whole-model conversion's, and transformers computes ptdp's logits from them."""
    from ptdp.checkpointing import read_full_model_state
    from ptdp.cli.main import main
    from ptdp.hf.convert import full_model_from_state, model_config_from_dict, moe_config_from_dict
    from ptdp.models.families import family_of

    tmp_path, runs = trained
    ckpt, out = runs["direct_t4"].ckpt, tmp_path / "exported"
    assert main(["export", "--load", str(ckpt), "--format", "hf", "--out", str(out), "--max-shard-size", "20KB"]) == 0
    assert "model.safetensors.index.json" in capsys.readouterr().out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and not (out / "model.safetensors").exists()
    streamed = {}
    for name in files:
        streamed.update(safetensors_torch.load_file(str(out / name)))
    assert set(streamed) == set(index["weight_map"])
    tensors, config = read_full_model_state(ckpt)  # the whole-model path: family.write on full tensors
    cfg, moe = model_config_from_dict(config), moe_config_from_dict(config)
    whole = family_of(cfg, moe).write(tensors, cfg, moe)
    assert streamed.keys() == whole.keys()
    for name, value in whole.items():
        assert torch.equal(streamed[name], value), name
    assert main(["export", "--load", str(ckpt), "--out", str(tmp_path / "bad"), "--max-shard-size", "lots"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "ptdp export: error: --max-shard-size 'lots': give a positive size such as 5GB, 500MB or 2GiB"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, full_model_from_state(tensors, config)(tokens)[..., :VOCAB],
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2_moe", "gemma3", "gpt2"])
def test_a_rank_reads_only_its_slice(tmp_path, kind):
    """Tensor-parallel rank 1 of 4 asks the reader for its boxes of the fused QKV (rows by key/value group)
    and of fc1 (``[2, f, h]``, split along f; Qwen2-MoE: its shared expert's, and its QKV bias): the reader
    reads exactly those rows of q_proj, k_proj, v_proj (their biases), gate_proj and up_proj, nothing
    else, and fills the boxes with the import's values."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    from ptdp.hf.convert import read_hf_tensors
    from ptdp.models.families import family_for_hf

    hf_model(tmp_path / "hf", kind)
    source = open_hf_dir(tmp_path / "hf")
    reader = HFStorageReader(source, source.recipes(384))
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    _, _, full = family_for_hf(hf_config["model_type"]).read(hf_config, read_hf_tensors(tmp_path / "hf"))
    t, rank, groups, d, f = 4, 1, 4, (8 if kind in ("qwen3", "gemma3") else 4), (24 if kind == "qwen2_moe" else 48)
    mlp = "mlp.shared_expert." if kind == "qwen2_moe" else "mlp."
    boxes = {"layers.1.attention.qkv.weight": 0, f"layers.1.{mlp}fc1.weight": 1}  # the dimension TP splits
    if kind == "qwen2_moe":
        boxes["layers.1.attention.qkv.bias"] = 0
    if kind == "gpt2":  # qkv [3, h, h] and its bias [3, h] split by head, fc1 [f, h] by row
        boxes = {"layers.1.attention.qkv.weight": 1, "layers.1.attention.qkv.bias": 1, "layers.1.mlp.fc1.weight": 0}
    targets, items = {}, []
    for name, dim in boxes.items():
        shape = full[name].shape
        offsets, lengths = [0] * len(shape), list(shape)
        lengths[dim] = shape[dim] // t
        offsets[dim] = rank * lengths[dim]
        targets[f"model.{name}"] = torch.empty(lengths)
        zero = torch.Size([0] * len(shape))
        items.append(ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(f"model.{name}"), dest_offsets=zero,
                              storage_index=MetadataIndex(f"model.{name}", zero),
                              storage_offsets=torch.Size(offsets), lengths=torch.Size(lengths)))

    class Planner:  # the two calls read_data makes of DCP's planner
        def resolve_tensor(self, item):
            return targets[item.dest_index.fqn]

        def commit_tensor(self, item, tensor):
            pass

    reader.read_data(LoadPlan(items), Planner()).wait()
    for item in items:
        box = tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths, strict=True))
        assert torch.equal(targets[item.dest_index.fqn], full[item.dest_index.fqn.removeprefix("model.")][box])
    q_rows = 8 // groups * d  # one group's query heads
    layer, h = "model.layers.1.", 32
    expected = {(layer + "self_attn.q_proj.weight", ((rank * q_rows, (rank + 1) * q_rows), (0, h))),
                (layer + "self_attn.k_proj.weight", ((rank * d, (rank + 1) * d), (0, h))),
                (layer + "self_attn.v_proj.weight", ((rank * d, (rank + 1) * d), (0, h))),
                (layer + mlp + "gate_proj.weight", ((rank * f // t, (rank + 1) * f // t), (0, h))),
                (layer + mlp + "up_proj.weight", ((rank * f // t, (rank + 1) * f // t), (0, h)))}
    if kind == "qwen2_moe":
        expected |= {(layer + "self_attn.q_proj.bias", ((rank * q_rows, (rank + 1) * q_rows),)),
                     (layer + "self_attn.k_proj.bias", ((rank * d, (rank + 1) * d),)),
                     (layer + "self_attn.v_proj.bias", ((rank * d, (rank + 1) * d),))}
    if kind == "gpt2":  # Conv1D [in, out]: a head's rows of q, k, v are columns of c_attn, fc1's rows c_fc's
        layer, w = "transformer.h.1.", h // t
        cols = [(j * h + rank * w, j * h + (rank + 1) * w) for j in range(3)]
        expected = ({(layer + "attn.c_attn.weight", ((0, h), c)) for c in cols}
                    | {(layer + "attn.c_attn.bias", (c,)) for c in cols}
                    | {(layer + "mlp.c_fc.weight", ((0, h), (rank * f // t, (rank + 1) * f // t)))})
    assert sorted(reader.reads) == sorted(expected)
    assert reader.bytes_read == sum(t.numel() for t in targets.values()) * 4  # fp32 files: the boxes, no more


def _read_whole(reader: HFStorageReader) -> dict[str, torch.Tensor]:
    """Every parameter read through ``reader`` as one box, by ptdp name."""
    return _read_boxes(reader, {key.removeprefix("model."): tuple((0, n) for n in meta.size)
                                for key, meta in reader.read_metadata().state_dict_metadata.items()})


def _read_boxes(reader: HFStorageReader, boxes: dict) -> dict[str, torch.Tensor]:
    """``boxes`` (ptdp name -> per dimension ``(start, stop)``) read through ``reader`` as DCP asks a rank."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    targets, items = {}, []
    for name, box in boxes.items():
        key, offsets, lengths = f"model.{name}", torch.Size([a for a, _ in box]), torch.Size([b - a for a, b in box])
        targets[key] = torch.empty(lengths)
        zero = torch.Size([0] * len(box))
        items.append(ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(key), dest_offsets=zero,
                              storage_index=MetadataIndex(key, zero), storage_offsets=offsets, lengths=lengths))

    class Planner:
        def resolve_tensor(self, item):
            return targets[item.dest_index.fqn]

        def commit_tensor(self, item, tensor):
            pass

    reader.read_data(LoadPlan(items), Planner()).wait()
    return {k.removeprefix("model."): v for k, v in targets.items()}


def test_a_bf16_directory_reads_as_the_import_reads_it(tmp_path):
    """bf16 files: the reader widens each slice to fp32 exactly as the import widens the whole tensor."""
    from ptdp.hf.convert import read_hf_tensors
    from ptdp.models.families import family_for_hf

    model = hf_model(tmp_path / "fp32")
    model.to(torch.bfloat16).save_pretrained(str(tmp_path / "hf"), safe_serialization=True, max_shard_size="20KB")
    source = open_hf_dir(tmp_path / "hf")
    assert set(source.dtypes.values()) == {"BF16"}
    got = _read_whole(HFStorageReader(source, source.recipes(384)))
    _, _, want = family_for_hf("llama").read(json.loads((tmp_path / "hf" / "config.json").read_text()),
                                             read_hf_tensors(tmp_path / "hf"))
    assert got.keys() == want.keys()
    for name, value in want.items():
        rows = min(value.shape[0], got[name].shape[0])  # the import pads the embedding later, with zeros
        assert torch.equal(got[name][:rows], value[:rows]) and not got[name][rows:].any(), name


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe", "gemma3", "gpt2", "gpt_oss",
                                  "deepseek_v3", "qwen3_next"])
def test_the_reader_builds_the_model_hf_computes(tmp_path, kind):
    """Every parameter read whole through the reader (one box each) makes a ptdp model with HF's logits."""
    from ptdp.hf.convert import full_model_from_state

    hf = hf_model(tmp_path / "hf", kind)
    source = open_hf_dir(tmp_path / "hf")
    tensors = _read_whole(HFStorageReader(source, source.recipes(384)))
    ours = full_model_from_state(tensors, {"model": {**vars(source.cfg)}, "moe": {**vars(source.moe)}})
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens)[..., :VOCAB], hf(tokens).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3", "qwen3_next"])
def test_fused_experts_read_as_the_per_expert_files(tmp_path, kind):
    """transformers 5's fused layout (``save_pretrained(..., save_original_format=False)``: one
    ``gate_up_proj``/``down_proj`` per layer, a Mixtral's router under ``mlp.``) reads bit for bit as the
    per-expert files ``save_pretrained`` writes by default, every parameter whole; and the box of expert rank 1
    of 2 and tensor rank 1 of 2 reads, of the fused tensors, only its two experts' rows of its half of gate,
    of up and of down's columns."""
    hf_model(tmp_path / "per-expert", kind)
    hf_model(tmp_path / "fused", kind, fused=True)
    per_expert, fused = open_hf_dir(tmp_path / "per-expert"), open_hf_dir(tmp_path / "fused")
    layer = "model.layers.1.mlp.experts."
    assert layer + "gate_up_proj" in fused.shapes and not any(".experts.0." in n for n in fused.shapes)
    assert layer + "gate_up_proj" not in per_expert.shapes
    want = _read_whole(HFStorageReader(per_expert, per_expert.recipes(384)))
    got = _read_whole(HFStorageReader(fused, fused.recipes(384)))
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    reader = HFStorageReader(fused, fused.recipes(384))
    _, h, f = fused.shapes[layer + "down_proj"]
    boxes = {"layers.1.mlp.experts.fc1_weight": ((2, 4), (0, 2), (f // 2, f), (0, h)),  # [E, 2, f, h] by f
             "layers.1.mlp.experts.fc2_weight": ((2, 4), (0, h), (f // 2, f))}  # [E, h, f] by f
    got = _read_boxes(reader, boxes)
    for name, box in boxes.items():
        assert torch.equal(got[name], want[name][tuple(slice(a, b) for a, b in box)]), name
    assert sorted(reader.reads) == sorted([(layer + "gate_up_proj", ((2, 4), (f // 2, f), (0, h))),
                                           (layer + "gate_up_proj", ((2, 4), (f + f // 2, 2 * f), (0, h))),
                                           (layer + "down_proj", ((2, 4), (0, h), (f // 2, f)))])
    assert reader.bytes_read == sum(v.numel() for v in got.values()) * 4


def test_a_qwen3_next_rank_reads_only_its_heads(tmp_path):
    """Tensor rank 1 of 2 of Qwen3-Next: the gated attention's QKV and output gate read their heads' query and
    gate rows of ``q_proj`` (interleaved per head) and their groups' k/v rows; the Gated DeltaNet's depthwise
    convolution reads key head 1's q, k and v channels of ``conv1d [C, 1, taps]``; all equal to the import's
    slices."""
    from ptdp.hf.convert import read_hf_tensors
    from ptdp.models.qwen3_next.hf import read_qwen3_next

    hf_model(tmp_path / "hf", "qwen3_next")
    source = open_hf_dir(tmp_path / "hf")
    _, _, full = read_qwen3_next(json.loads((tmp_path / "hf" / "config.json").read_text()),
                                 read_hf_tensors(tmp_path / "hf"))
    reader = HFStorageReader(source, source.recipes(384))
    d, h, taps = 8, 32, 4  # 8 heads in 4 groups; rank 1: heads 4-7, groups 2-3
    boxes = {"layers.1.attention.gate.weight": ((4 * d, 8 * d), (0, h)),
             "layers.1.attention.qkv.weight": ((2 * 4 * d, 4 * 4 * d), (0, h)),  # a group: 2 q, 1 k, 1 v heads
             "layers.0.attention.conv1d.weight": ((32, 64), (0, taps))}  # a key head: 8 q, 8 k, 16 v channels
    got = _read_boxes(reader, boxes)
    for name, box in boxes.items():
        assert torch.equal(got[name], full[name][tuple(slice(a, b) for a, b in box)]), name
    q, attn, conv = "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.", \
        "model.layers.0.linear_attn.conv1d.weight"
    expected = [(q, ((2 * j * d + d, 2 * j * d + 2 * d), (0, h))) for j in range(4, 8)]  # the gates
    for group in (2, 3):
        expected += [(q, ((2 * j * d, 2 * j * d + d), (0, h))) for j in (2 * group, 2 * group + 1)]  # the queries
        expected += [(attn + f"{x}_proj.weight", ((group * d, (group + 1) * d), (0, h))) for x in "kv"]
    expected += [(conv, (rows, (0, 1), (0, taps))) for rows in ((8, 16), (24, 32), (48, 64))]
    assert sorted(reader.reads) == sorted(expected)


@pytest.mark.parametrize("kind", ["qwen2_moe", "deepseek_v3", "qwen3_next"])
def test_the_printed_expert_flags_load_and_a_run_without_the_shared_expert_is_refused(tmp_path, kind):
    """The launcher's check of ``--load HF_DIR`` passes the MoE flags ``ptdp import`` prints for the directory
    (the shared expert and router flags compared too), and refuses a run that drops the shared expert's
    size: its model would have no shared expert, and the directory's would go unread."""
    from ptdp.checkpointing.validation import hf_load_errors
    from ptdp.cli.main import build_parser
    from ptdp.config.load import config_from_args

    hf_model(tmp_path / "hf", kind)
    source = open_hf_dir(tmp_path / "hf")
    flags = ["train", *shlex.split(train_flags(source.cfg, source.moe)), *RUN, "--load", str(tmp_path / "hf")]
    assert hf_load_errors(config_from_args(build_parser().parse_args(flags)), tmp_path / "hf") == []
    at = flags.index("--moe-shared-expert-intermediate-size")
    shared = flags.pop(at + 1)
    flags.pop(at)
    errors = hf_load_errors(config_from_args(build_parser().parse_args(flags)), tmp_path / "hf")
    assert len(errors) == 1 and f"--moe-shared-expert-intermediate-size {shared} there, None here" in errors[0], errors


@pytest.mark.parametrize("damage,fragment", [
    ("missing_shard", "is missing (named by model.safetensors.index.json)"),
    ("index_names_missing_tensor", "has no tensor model.layers.0.mlp.bogus.weight"),
    ("unsupported_field", "hidden_act='gelu'"),
    ("wrong_flags", "--hidden-size 32 there, 64 here"),
])
def test_bad_hf_dir_is_refused_before_workers_start(tmp_path, capsys, damage, fragment):
    """The launcher's start-up checks: one line naming the file (or flag), exit 2, no worker started (the
    first case as a real ``ptdp train`` process, the others through the same ``main`` in this process)."""
    hf_model(tmp_path / "hf")
    _, cfg, moe = import_hf_model(tmp_path / "hf", tmp_path / "ckpt")
    flags = [*shlex.split(train_flags(cfg, moe)), *RUN]
    index_file = tmp_path / "hf" / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    if damage == "missing_shard":
        sorted((tmp_path / "hf").glob("model-*.safetensors"))[1].unlink()
    elif damage == "index_names_missing_tensor":
        index["weight_map"]["model.layers.0.mlp.bogus.weight"] = sorted(index["weight_map"].values())[0]
        index_file.write_text(json.dumps(index))
    elif damage == "unsupported_field":
        config = json.loads((tmp_path / "hf" / "config.json").read_text())
        config["hidden_act"] = "gelu"
        (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    else:
        flags[flags.index("--hidden-size") + 1] = "64"
    argv = ["train", *flags, "--load", str(tmp_path / "hf"), "--nproc-per-node", "2"]
    if damage == "missing_shard":
        proc = run_ptdp(argv, check=False)
        code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    else:
        from ptdp.cli.main import main

        capsys.readouterr()
        code = main(argv)
        stdout, stderr = capsys.readouterr()
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ptdp train: error: --load ") and fragment in lines[0], lines
    assert "iteration" not in stdout, stdout  # no worker trained


def test_transpose_and_unflatten_read_any_box_and_scatter_back():
    """GPT-2's recipe ops: a box of ``Unflatten(Transpose(c_attn))`` reads, per q/k/v block, just its columns
    of the ``[in, out]`` tensor, and matches the whole tensor's slice; ``scatter`` gives the HF tensors back."""
    from ptdp.models.hf_recipe import Take, Transpose, Unflatten
    from ptdp.models.hf_tensors import materialize

    hf = {"w": torch.arange(24.0).view(4, 6), "b": torch.arange(6.0)}  # Conv1D [in 4, out 3·2]
    recipes = {"qkv": Unflatten(Transpose(Take("w")), 3), "bias": Unflatten(Take("b"), 3)}
    full = materialize(recipes, hf)
    assert torch.equal(full["qkv"], hf["w"].t().reshape(3, 2, 4)) and torch.equal(full["bias"], hf["b"].view(3, 2))
    reads = []

    def fetch(name, box):
        reads.append((name, box))
        return hf[name][tuple(slice(a, b) for a, b in box)]

    shapes = {name: tuple(t.shape) for name, t in hf.items()}
    assert torch.equal(recipes["qkv"].read(((0, 3), (1, 2), (1, 3)), shapes, fetch), full["qkv"][:, 1:2, 1:3])
    assert reads == [("w", ((1, 3), (2 * j + 1, 2 * j + 2))) for j in range(3)]
    for name, recipe in recipes.items():
        (hf_name, rows, value), = recipe.scatter(full[name])
        assert rows is None and torch.equal(value, hf[hf_name]), name


def test_an_mxfp4_box_decodes_only_its_rows_and_blocks():
    """GPT-OSS's expert recipe over MXFP4 files: tensor rank 1 of 2's box of ``fc1_weight [E, 2, f, h]``
    (rows f/2..f of gate and of up) reads blocks and scales rows ``[f, 2f)`` of the interleaved ``2f`` only,
    and a box of columns only the 32-value blocks it touches; both equal the whole tensor's slice, which is
    the unquantized layout's (``transformers``' dequantization: ``test_gpt_oss.py``). Export (``scatter``)
    writes the unquantized tensor."""
    from ptdp.models.gpt_oss.hf import gpt_oss_recipes
    from ptdp.models.hf_tensors import materialize
    from ptdp.models.mxfp4 import dequantize_mxfp4

    g = torch.Generator().manual_seed(0)
    e, f, h = 2, 8, 64  # two 32-value blocks per row of gate_up
    layer = "model.layers.0.mlp.experts.gate_up_proj"
    hf = {layer + "_blocks": torch.randint(0, 256, (e, 2 * f, h // 32, 16), generator=g, dtype=torch.uint8),
          layer + "_scales": torch.randint(120, 130, (e, 2 * f, h // 32), generator=g, dtype=torch.uint8)}
    cfg = transformers_free_config(h, f, e)
    recipe = gpt_oss_recipes(*cfg, 8)["layers.0.mlp.experts.fc1_weight"]
    shapes = {name: tuple(t.shape) for name, t in hf.items()}
    reads = []

    def fetch(name, box):
        reads.append((name, box))
        return hf[name][tuple(slice(a, b) for a, b in box)]

    whole = materialize({"fc1": recipe}, hf)["fc1"]
    unquantized = dequantize_mxfp4(hf[layer + "_blocks"], hf[layer + "_scales"])  # HF's [E, h, 2f]
    assert torch.equal(whole, torch.stack([unquantized[..., 0::2], unquantized[..., 1::2]], 1).transpose(2, 3))
    box = ((0, e), (0, 2), (f // 2, f), (0, h))
    assert torch.equal(recipe.read(box, shapes, fetch), whole[:, :, f // 2:])
    assert reads == [(layer + "_blocks", ((0, e), (f, 2 * f), (0, 2), (0, 16))),
                     (layer + "_scales", ((0, e), (f, 2 * f), (0, 2)))]
    reads.clear()
    assert torch.equal(recipe.read(((1, 2), (1, 2), (0, f), (40, 50)), shapes, fetch), whole[1:, 1:, :, 40:50])
    assert [box[-2:] if "blocks" in name else box[-1:] for name, box in reads] == [((1, 2), (0, 16)), ((1, 2),)]
    (name, rows, value), = recipe.scatter(whole)
    assert name == layer and rows is None and torch.equal(value, unquantized)


def transformers_free_config(h: int, f: int, e: int):
    """The GPT-OSS flags of a one-layer model with ``e`` experts of width ``f`` (for its recipes alone)."""
    from ptdp.models.gpt_oss.hf import gpt_oss_model

    return gpt_oss_model({"vocab_size": 8, "hidden_size": h, "intermediate_size": f, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "num_local_experts": e,
                          "num_experts_per_tok": 1, "sliding_window": 4, "layer_types": ["full_attention"],
                          "max_position_embeddings": 64, "rope_parameters": {"rope_type": "default",
                                                                             "rope_theta": 1e4}})
