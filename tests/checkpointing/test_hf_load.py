"""``ptdp train --load HF_DIR``: a Hugging Face directory (several safetensors shards) loads directly, each
rank reading only its slices, and trains bit for bit as ``ptdp import`` + ``--load CKPT`` does; a bad
directory stops before any worker with one line naming the file. ``ptdp export`` streams tensor by tensor
into HF's sharded layout, which transformers loads."""

from __future__ import annotations

import json

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


def hf_model(directory, kind: str = "llama"):
    """A random HF model saved in three or more shards (and its index); GQA with 8 query heads in 4 groups."""
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
    else:  # Qwen2-MoE: 4 experts, top 2 without renormalising, a gated shared expert, QKV biases
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=24, norm_topk_prob=False, qkv_bias=True))
    with torch.no_grad():  # HF starts biases and Gemma's (1 + w) norms at zero: random ones, so that a misplaced
        for name, param in model.named_parameters():  # bias or norm shows
            if name.endswith(".bias") or name.endswith("norm.weight") or ".ln_" in name:
                param.add_(torch.randn_like(param) * 0.5)
    model.save_pretrained(str(directory), safe_serialization=True, max_shard_size="20KB")
    assert len(list(directory.glob("model-*.safetensors"))) >= 3
    return model.eval()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An HF Llama directory, its import, and four runs: --load of each, at t = 4, and at p = 2 with d = 2
    under ZeRO-3 (the weights loaded as flat pieces, ``checkpointing/sharded.py``'s boxes)."""
    tmp_path = tmp_path_factory.mktemp("hf_load")
    hf_model(tmp_path / "hf")
    _, cfg, moe = import_hf_model(tmp_path / "hf", tmp_path / "ckpt")
    shape = [*train_flags(cfg, moe).split(), *RUN]
    t4 = ["--tensor-model-parallel-size", "4"]  # pads 257 to 384 rows, as the import did
    z3 = ["--pipeline-model-parallel-size", "2", "--data-parallel-sharding-strategy", "optim_grads_params"]
    runs = run_layouts(tmp_path / "runs", {
        "import_t4": (4, [*t4, "--load", str(tmp_path / "ckpt")]),
        "direct_t4": (4, [*t4, "--load", str(tmp_path / "hf")]),
        "import_z3": (4, [*z3, "--load", str(tmp_path / "ckpt")]),
        "direct_z3": (4, [*z3, "--load", str(tmp_path / "hf")]),
    }, base=shape)
    return tmp_path, runs


def test_load_hf_dir_at_t4_equals_import_then_load(trained):
    """Losses, gradient norms (every iteration) and the final weights: bit for bit, at t = 4 and at p = 2,
    d = 2 with ZeRO-3."""
    _, runs = trained
    for layout in ("t4", "z3"):
        direct, imported = runs[f"direct_{layout}"], runs[f"import_{layout}"]
        assert [(r["loss"], r["grad_norm"]) for r in direct.records] == \
            [(r["loss"], r["grad_norm"]) for r in imported.records] != []
        assert direct.weights.keys() == imported.weights.keys()
        for name, value in imported.weights.items():
            assert torch.equal(direct.weights[name], value), (layout, name)


@pytest.mark.parametrize("kind,layout", [("qwen3_moe", ["--expert-model-parallel-size", "2"]),
                                         ("qwen2_moe", ["--tensor-model-parallel-size", "2"]),
                                         ("gemma3", ["--tensor-model-parallel-size", "2"]),
                                         ("gpt2", ["--tensor-model-parallel-size", "2"])])
def test_hf_dir_on_two_ranks_equals_import_then_load(tmp_path, kind, layout):
    """Qwen3-MoE with its experts split over two ranks (e = 2, d = 2); Qwen2-MoE at t = 2 (its QKV biases,
    shared expert and experts split by tensor rank); Gemma 3 at t = 2 (its q/k and sandwich norms, the tied
    embedding); GPT-2 at t = 2 (columns of its transposed Conv1D weights): bit for bit as the import."""
    hf_model(tmp_path / "hf", kind)
    _, cfg, moe = import_hf_model(tmp_path / "hf", tmp_path / "ckpt")
    runs = run_layouts(tmp_path / "runs", {"import": (2, [*layout, "--load", str(tmp_path / "ckpt")]),
                                           "direct": (2, [*layout, "--load", str(tmp_path / "hf")])},
                       base=[*train_flags(cfg, moe).split(), *RUN])
    direct, imported = runs["direct"], runs["import"]
    assert [(r["loss"], r["grad_norm"]) for r in direct.records] == \
        [(r["loss"], r["grad_norm"]) for r in imported.records] != []
    for name, value in imported.weights.items():
        assert torch.equal(direct.weights[name], value), name


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
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    targets, items = {}, []
    for key, meta in reader.read_metadata().state_dict_metadata.items():
        targets[key] = torch.empty(meta.size)
        zero = torch.Size([0] * len(meta.size))
        items.append(ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(key), dest_offsets=zero,
                              storage_index=MetadataIndex(key, zero), storage_offsets=zero, lengths=meta.size))

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


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe", "gemma3", "gpt2"])
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
    flags = [*train_flags(cfg, moe).split(), *RUN]
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
    from ptdp.models.hf_recipe import Take, Transpose, Unflatten, materialize, read_box, scatter

    hf = {"w": torch.arange(24.0).view(4, 6), "b": torch.arange(6.0)}  # Conv1D [in 4, out 3·2]
    recipes = {"qkv": Unflatten(Transpose(Take("w")), 3), "bias": Unflatten(Take("b"), 3)}
    full = materialize(recipes, hf)
    assert torch.equal(full["qkv"], hf["w"].t().reshape(3, 2, 4)) and torch.equal(full["bias"], hf["b"].view(3, 2))
    reads = []

    def fetch(name, box):
        reads.append((name, box))
        return hf[name][tuple(slice(a, b) for a, b in box)]

    shapes = {name: tuple(t.shape) for name, t in hf.items()}
    assert torch.equal(read_box(recipes["qkv"], ((0, 3), (1, 2), (1, 3)), shapes, fetch), full["qkv"][:, 1:2, 1:3])
    assert reads == [("w", ((1, 3), (2 * j + 1, 2 * j + 2))) for j in range(3)]
    for name, recipe in recipes.items():
        (hf_name, rows, value), = scatter(recipe, full[name])
        assert rows is None and torch.equal(value, hf[hf_name]), name
