"""Megatron-LM checkpoints: ``ptdp import --format megatron`` and ``ptdp export --format megatron``.

With megatron-core installed (CI installs it; ``pip install --no-deps megatron-core``), one module fixture
runs Megatron-Core's side in two process starts (tests/checkpointing/megatron_script.py under torchrun with
gloo): tiny GPT-2-style, Llama-style and MoE (4 SwiGLU experts, top-2) models saved at (t, p) = (2, 2),
which ptdp imports (``ptdp import`` in the test's own process) and must give Megatron's logits, ptdp's export loaded back into
Megatron-Core at another layout with ptdp's logits, and a run of Megatron's DistributedOptimizer whose Adam
state ptdp must continue exactly. Without megatron-core those tests are skipped; the rest (the formats,
round trips, the refusals) use files written here.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_same_run, assert_same_training, run_command, run_layouts, worker_env

from ptdp.checkpointing import read_full_model_state, write_full_model_state
from ptdp.hf.convert import full_model_from_state
from ptdp.megatron.args import MegatronError
from ptdp.megatron.command import continue_flags, import_megatron
from ptdp.megatron.read import read_checkpoint
from ptdp.megatron.write import export_megatron

SCRIPT = Path(__file__).resolve().parent / "megatron_script.py"
sys.path.insert(0, str(SCRIPT.parent))
from megatron_script import TOKENS, VOCAB, run_args  # noqa: E402

needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                    or importlib.util.find_spec("megatron.core") is None,
                                    reason="megatron-core is not installed (pip install --no-deps megatron-core)")


def _ptdp(args: list[str]) -> subprocess.CompletedProcess:
    """``ptdp ARGS`` (import, export: one process, no training) in the test's own process, its exit status
    and output as a process would give them, without a Python and torch start for each (~4 s of CPU)."""
    from ptdp.cli.main import main as ptdp_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = ptdp_main(args)
        except SystemExit as e:  # the argument parser's refusal: the exit status a process would have
            code = e.code
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def _megatron_jobs(root: Path, name: str, nproc: int, jobs: list[dict]) -> None:
    """Run ``jobs`` (megatron_script.py's) in one torchrun of ``nproc`` processes."""
    (root / f"{name}.json").write_text(json.dumps(jobs))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(SCRIPT), str(root / f"{name}.json")]
    proc = run_command(command, timeout=600, env=worker_env())
    assert proc.returncode == 0, proc.stderr[-4000:]


KINDS = {"gpt": (2, 1), "llama": (1, 2), "moe": (2, 1)}  # kind -> the (t, p) Megatron loads ptdp's export at
ADAM_RUN = ["--lr", "1e-3", "--train-iters", "20", "--seed", "1234", "--global-batch-size", "8",
            "--micro-batch-size", "2"]


@pytest.fixture(scope="module")
def megatron(tmp_path_factory) -> Path:
    """Megatron-Core's side of every test here, in two process starts: the three models saved at
    (t, p) = (2, 2) (``saves/KIND``, with their logits); ptdp's import of each (``ptdp/KIND``, the command's
    output in ``ptdp/KIND.txt``) and export (``back/KIND``); then on two processes each export loaded at
    its ``KINDS`` layout (``back/KIND.pt``, the logits). With the saves, on four processes, one run with
    Megatron's DistributedOptimizer at (t, p, d) = (2, 1, 2) on ptdp's first three global batches of the
    continued run's data: saved at iteration 2 (``adam/``, and in Megatron-LM's default optimizer format
    ``adam/dp_reshardable``), its third step in ``adam/next.pt``."""
    import numpy as np
    from helpers import validated_config

    from ptdp.data.training_data import datasets_for_config

    root = tmp_path_factory.mktemp("megatron")
    flags = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
             "--vocab-size", str(VOCAB), *ADAM_RUN]
    train = datasets_for_config(validated_config(flags)).train
    samples = np.stack([train[i] for i in range(3 * 8)]).astype(np.int64)
    torch.save(torch.from_numpy(samples).reshape(3, 8, -1), root / "batches.pt")
    jobs = [{"mode": "save", "kind": kind, "t": 2, "p": 2, "dir": str(root / "saves" / kind)} for kind in KINDS]
    jobs.append({"mode": "train", "kind": "gpt", "t": 2, "p": 1, "dir": str(root / "adam"),
                 "out": str(root / "batches.pt")})
    _megatron_jobs(root, "saves", 4, jobs)
    for kind in KINDS:
        result = _ptdp(["import", "--format", "megatron", "--in", str(root / "saves" / kind),
                        "--save", str(root / "ptdp" / kind)])
        assert result.returncode == 0, result.stderr
        (root / "ptdp" / f"{kind}.txt").write_text(result.stdout)
        export_megatron(root / "ptdp" / kind, root / "back" / kind)
    _megatron_jobs(root, "loads", 2, [{"mode": "load", "kind": kind, "t": t, "p": p, "dir": str(root / "back" / kind),
                                       "out": str(root / "back" / f"{kind}.pt")} for kind, (t, p) in KINDS.items()])
    return root


def _ptdp_logits(save: Path) -> torch.Tensor:
    tensors, config = read_full_model_state(save)
    with torch.no_grad():
        return full_model_from_state(tensors, config)(TOKENS)[..., :VOCAB]


@needs_megatron
@pytest.mark.parametrize("kind", list(KINDS))
def test_megatron_save_imports_to_its_logits_and_exports_back(megatron, kind):
    """Megatron-Core's save at (t, p) = (2, 2) imports into one process (another layout) with Megatron's
    logits; ptdp's export loads back into Megatron-Core at yet another layout, from other initial weights,
    with ptdp's logits."""
    expected = torch.load(megatron / "saves" / kind / "logits.pt")
    stdout = (megatron / "ptdp" / f"{kind}.txt").read_text()
    assert "iteration 10, 80 samples consumed" in stdout
    assert "--global-batch-size 8" in stdout and "--train-iters 20" in stdout
    ours = _ptdp_logits(megatron / "ptdp" / kind)
    torch.testing.assert_close(ours, expected, rtol=0, atol=2e-5)
    torch.testing.assert_close(torch.load(megatron / "back" / f"{kind}.pt"), ours, rtol=0, atol=2e-5)


# ------------------------------------------------------------------------- without megatron-core

def _ptdp_model(tmp_path: Path, kind: str) -> Path:
    """A random ptdp checkpoint of the Megatron test model's shape (its args mapped by ptdp itself)."""
    from ptdp.megatron.args import model_from_args

    if (tmp_path / f"{kind}-ptdp").exists():
        return tmp_path / f"{kind}-ptdp"

    cfg, moe = model_from_args(vars(run_args(kind, 1, 1)))
    from dataclasses import asdict

    from ptdp.models import GPTModel

    torch.manual_seed(0)
    model = GPTModel(cfg, VOCAB, VOCAB, moe)
    tensors = {k: torch.randn_like(v) * 0.2 for k, v in model.state_dict().items()}
    return write_full_model_state(tmp_path / f"{kind}-ptdp", tensors, {"model": asdict(cfg), "moe": asdict(moe)}).parent


def _megatron_save(tmp_path: Path, kind: str, iteration: int = 10) -> Path:
    """A torch_dist save (ptdp's export) with the args and iteration a Megatron-LM run records."""
    out = tmp_path / f"{kind}-megatron"
    release = export_megatron(_ptdp_model(tmp_path, kind), out)
    save = out / f"iter_{iteration:07d}"
    release.rename(save)
    common = torch.load(save / "common.pt", weights_only=False)
    common.update(args=run_args(kind, 2, 2), iteration=iteration)
    torch.save(common, save / "common.pt")
    (out / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return out


@pytest.mark.parametrize("kind", ["gpt", "llama", "moe"])
def test_export_then_import_is_exact_and_keeps_the_run_position(tmp_path, kind):
    source = _ptdp_model(tmp_path, kind)
    imported = import_megatron(_megatron_save(tmp_path, kind), tmp_path / "again")
    assert (imported.iteration, imported.consumed_samples) == (10, 80)
    before, _ = read_full_model_state(source)
    after, config = read_full_model_state(tmp_path / "again")
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name
    info = json.loads((imported.path / "ptdp.json").read_text())
    assert (info["iteration"], info["consumed_samples"]) == (10, 80)
    assert config["training"]["global_batch_size"] == 8


def test_imported_run_continues_from_megatrons_next_sample_in_any_layout(tmp_path):
    """The printed flags continue the run: iteration 11 reads samples 80..87 (consumed 88 after it), and the
    imported model trains the same at (t, p) = (2, 2) as in one process."""
    imported = import_megatron(_megatron_save(tmp_path, "llama"), tmp_path / "imported")
    flags = continue_flags(imported).split() + ["--load", str(imported.path.parent), "--train-iters", "12",
                                                "--log-interval", "1", "--lr", "1e-3"]
    assert flags[flags.index("--global-batch-size") + 1] == "8"
    runs = run_layouts(tmp_path / "runs", {"one": (1, []), "t2p2": (4, ["--tensor-model-parallel-size", "2",
                                                                         "--pipeline-model-parallel-size", "2"])},
                       base=flags, save=False)  # the later --train-iters 12 overrides the printed 20
    assert [(r["iteration"], r["consumed_samples"]) for r in runs["one"].records] == [(11, 88), (12, 96)]
    assert_same_run(runs["t2p2"], runs["one"])


def _split_legacy(save: Path, t: int, p: int) -> None:
    """Rewrite a torch_dist save as Megatron-LM's older torch format: per (t, p) rank its slice of each
    parameter (column-parallel rows, row-parallel columns, SwiGLU's gate and up halves each), stage-local
    layer numbers, local-layer norm names."""
    ckpt = read_checkpoint(save)
    args = ckpt.args | {"tensor_model_parallel_size": t, "pipeline_model_parallel_size": p}
    per_stage = args["num_layers"] // p
    directory = save / "iter_0000010"
    shutil.rmtree(directory)
    local = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
             "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
             "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
             "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}
    for pp in range(p):
        for tp in range(t):
            model = {}
            for name, value in ckpt.tensors.items():
                if name.startswith("decoder.layers."):
                    i, rest = name.removeprefix("decoder.layers.").split(".", 1)
                    if int(i) // per_stage != pp:
                        continue
                    name = f"decoder.layers.{int(i) - pp * per_stage}.{local.get(rest, rest)}"
                    model[name.replace("weight", "_extra_state").rsplit(".", 1)[0] + "._extra_state"] = None
                elif (name.startswith("embedding") and pp != 0) or (not name.startswith("embedding") and pp != p - 1):
                    continue
                if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
                    value = value.chunk(t, dim=1)[tp]
                elif name.endswith(("linear_fc1.weight", "linear_fc1.bias")) and args["swiglu"]:
                    gate, up = value.chunk(2, dim=0)
                    value = torch.cat([gate.chunk(t)[tp], up.chunk(t)[tp]])
                elif name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
                                    "word_embeddings.weight", "output_layer.weight")):
                    value = value.chunk(t, dim=0)[tp]
                model[name] = value.clone()
            rank_dir = directory / (f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if p > 1 else ""))
            rank_dir.mkdir(parents=True)
            torch.save({"model": model, "args": argparse.Namespace(**args), "iteration": 10,
                        "checkpoint_version": 3.0}, rank_dir / "model_optim_rng.pt")


@pytest.mark.parametrize("kind", ["gpt", "llama", "moe"])
def test_torch_format_joins_the_ranks_slices(tmp_path, kind):
    save = _megatron_save(tmp_path, kind)
    expected = import_megatron(save, tmp_path / "from-dist")
    _split_legacy(save, t=2, p=2)
    assert read_checkpoint(save).format == "torch"
    got = import_megatron(save, tmp_path / "from-torch")
    assert (got.iteration, got.consumed_samples) == (10, 80)
    a, _ = read_full_model_state(expected.path.parent)
    b, _ = read_full_model_state(got.path.parent)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _edit_args(save: Path, **changes) -> None:
    path = save / "iter_0000010" / "common.pt"
    common = torch.load(path, weights_only=False)
    common["args"] = argparse.Namespace(**(vars(common["args"]) | changes))
    torch.save(common, path)


@pytest.mark.parametrize("change, named", [
    ({"squared_relu": True}, "squared_relu"),
    ({"normalization": "LayerNorm1P"}, "normalization"),
    ({"position_embedding_type": "yarn"}, "position_embedding_type"),
    ({"rotary_interleaved": True}, "rotary_interleaved"),
    ({"consumed_train_samples": 72}, "rampup_batch_size"),
])
def test_what_ptdp_cannot_compute_is_refused_by_name(tmp_path, change, named):
    save = _megatron_save(tmp_path, "gpt")
    _edit_args(save, **change)
    with pytest.raises(MegatronError, match=named):
        import_megatron(save, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _refused_in_one_line(save: Path, out: Path, text: str) -> None:
    result = _ptdp(["import", "--format", "megatron", "--in", str(save), "--save", str(out)])
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ptdp import: error: --in") and text in lines[0], result.stderr
    assert not out.exists()  # nothing written


def test_partial_and_corrupt_saves_are_refused_in_one_line(tmp_path):
    save = _megatron_save(tmp_path, "llama")
    iteration = save / "iter_0000010"
    distcp = next(iteration.glob("*.distcp"))
    data = distcp.read_bytes()
    distcp.write_bytes(data[: len(data) // 2])
    _refused_in_one_line(save, tmp_path / "out", "a .distcp file is missing or corrupt")
    for broken, named in [(lambda: (save / "latest_checkpointed_iteration.txt").write_text("12"),
                           "names iter_0000012, which is missing"),
                          (lambda: (save / "latest_checkpointed_iteration.txt").write_text("10") and distcp.unlink(),
                           "a .distcp file is missing or corrupt"),
                          (lambda: (iteration / "common.pt").unlink(), "common.pt is missing"),
                          (lambda: (iteration / "metadata.json").write_text("{"), "not valid JSON")]:
        broken()
        with pytest.raises(MegatronError, match=named):
            import_megatron(save, tmp_path / "out")
        assert not (tmp_path / "out").exists()


def test_optimizer_state_needs_no_load_optim(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    save = _megatron_save(tmp_path, "gpt")
    iteration = save / "iter_0000010"
    saved = dcp.FileSystemReader(iteration).read_metadata().state_dict_metadata
    tensors = {k: torch.empty(m.size) for k, m in saved.items() if isinstance(m, TensorStorageMetadata)}
    dcp.load(tensors, checkpoint_id=iteration, no_dist=True)
    for path in [*iteration.glob("*.distcp"), iteration / ".metadata"]:
        path.unlink()
    tensors["optimizer.state.exp_avg.embedding.word_embeddings.weight"] = torch.zeros(VOCAB, 32)
    dcp.save(tensors, checkpoint_id=iteration, no_dist=True)  # as a save with the distributed optimizer's state
    with pytest.raises(MegatronError, match="--no-load-optim"):
        import_megatron(save, tmp_path / "out")
    assert import_megatron(save, tmp_path / "out", no_load_optim=True).iteration == 10


def test_export_needs_a_fresh_directory(tmp_path):
    model = _ptdp_model(tmp_path, "gpt")
    export_megatron(model, tmp_path / "m")
    result = _ptdp(["export", "--format", "megatron", "--load", str(model), "--out", str(tmp_path / "m")])
    assert result.returncode == 2 and "already holds a Megatron-LM save" in result.stderr
    assert sorted(os.listdir(tmp_path / "m")) == ["latest_checkpointed_iteration.txt", "release"]


# ------------------------------------------------------------------------- the distributed optimizer

def _megatron_weights(next_step: dict, config: dict) -> dict[str, torch.Tensor]:
    """Megatron's weights after its third step (per tensor-parallel rank) as ptdp's full tensors."""
    from ptdp.hf.convert import model_config_from_dict, moe_config_from_dict
    from ptdp.megatron.names import canonical, to_ptdp
    from ptdp.megatron.read import _join

    full = {canonical(name): _join(canonical(name), parts, False) for name, parts in next_step["weights"].items()}
    return to_ptdp(full, model_config_from_dict(config), moe_config_from_dict(config))


def _optimizer_state(save: Path) -> dict[str, torch.Tensor]:
    """A ptdp checkpoint's Adam state per parameter (``optimizer.<name>.<field>``)."""
    import torch.distributed.checkpoint as dcp

    weights, _ = read_full_model_state(save)
    state = {f"optimizer.{name}.{field}": torch.empty(() if field == "step" else value.shape)
             for name, value in weights.items() for field in ("exp_avg", "exp_avg_sq", "step")}
    dcp.load(state, checkpoint_id=next(save.glob("iter_*")), no_dist=True)
    return state


@needs_megatron
def test_megatron_adam_state_continues_as_megatrons_next_step(megatron, tmp_path):
    """ptdp imports Megatron's model and Adam state (moments, step count) at iteration 2, saved at
    (t, d) = (2, 2) from several gradient buckets per rank, in Megatron-LM's default ``dp_reshardable``
    format and in the torch format's ``distrib_optim.pt``: both rebuild the buckets' layout, and give the
    same state. Iteration 3 from the one in one process and from the other at (p, d) = (2, 2) with ptdp's
    distributed optimizer: the loss, the gradient norm and every weight are Megatron's own third step's (the
    moments matter: a fresh Adam's first step moves each weight by about the learning rate, far from Adam's
    continued step)."""
    stdout = {}
    for name in ("dp_reshardable", "torch"):
        result = _ptdp(["import", "--format", "megatron", "--in", str(megatron / "adam" / name),
                        "--save", str(tmp_path / name)])
        assert result.returncode == 0, result.stderr
        stdout[name] = result.stdout
        assert "iteration 2, 16 samples consumed" in stdout[name]
    flags = stdout["torch"].split("ptdp train ", 1)[1].split()
    assert stdout["dp_reshardable"].split("ptdp train ", 1)[1].split()[2:] == flags[2:]  # all but --load
    assert "--adam-beta2" in flags and flags[flags.index("--lr-decay-style") + 1] == "constant"
    buckets, legacy = _optimizer_state(tmp_path / "dp_reshardable"), _optimizer_state(tmp_path / "torch")
    for key in buckets:
        assert torch.equal(legacy[key], buckets[key]), key
    runs = run_layouts(tmp_path / "runs", {
        "one": (1, ["--load", str(tmp_path / "dp_reshardable")]),
        "p2d2": (4, ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"])},
        base=flags + ["--train-iters", "3", "--log-interval", "1"])
    expected = torch.load(megatron / "adam" / "next.pt")
    start, config = read_full_model_state(tmp_path / "torch")
    megatron = _megatron_weights(expected, config)
    for name, run in runs.items():
        (record,) = run.records
        assert record["iteration"] == 3, name
        assert record["loss"] == pytest.approx(expected["loss"], rel=1e-5), name
        assert record["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4), name
        weights, _ = read_full_model_state(run.ckpt)
        assert_same_training(*(_without_key_bias(w) for w in (weights, megatron, start)))


@needs_megatron
def test_megatron_fully_reshardable_from_several_buckets_is_refused(megatron, tmp_path):
    """megatron-core 0.16.1 gathers the buffer without its buckets' end padding, then cuts each parameter at
    its padded offset: from several buckets the ``fully_reshardable`` values are shifted (the fp32 copy of a
    weight is not the weight), so ptdp refuses them rather than resume from other numbers."""
    from ptdp.megatron.read import read_checkpoint

    ckpt = read_checkpoint(megatron / "adam", read_optimizer=True)
    name = "decoder.layers.0.mlp.linear_fc2.bias"
    assert not torch.equal(ckpt.optimizer["param"][name], ckpt.tensors[name])  # Megatron's own save is off
    with pytest.raises(MegatronError, match="several gradient buckets"):
        import_megatron(megatron / "adam", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert import_megatron(megatron / "adam", tmp_path / "model", no_load_optim=True).iteration == 2


def _without_key_bias(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The key bias's gradient is zero up to rounding (softmax ignores a shift shared by every key), and
    Adam scales that rounding noise up to a step: it is the one weight two exact runs may move apart."""
    return {name: value[[0, 2]] if name.endswith("qkv.bias") else value for name, value in weights.items()}


@needs_megatron
@pytest.mark.parametrize("change, named", [
    ({"transformer_impl": "transformer_engine"}, "does not match the save"),  # the input norm's place moves
    ({"ddp_bucket_size": 8000}, "gradient buckets hold"),
    ({"data_parallel_size": None}, "lack data_parallel_size"),
    ({"transformer_impl": None}, "transformer_impl=None"),
    ({"num_distributed_optimizer_instances": 2}, "num_distributed_optimizer_instances=2"),
])
def test_megatron_bucket_layout_ptdp_cannot_rebuild_is_refused(megatron, tmp_path, change, named):
    """A dp_reshardable save whose args would give another gradient-bucket layout than the one it was saved
    with is refused, nothing written: the rebuilt layout is checked against the recorded bucket sizes and
    the pieces' boundaries before a value is read."""
    save = tmp_path / "save"
    shutil.copytree(megatron / "adam" / "dp_reshardable", save)
    path = save / "iter_0000002" / "common.pt"
    common = torch.load(path, weights_only=False)
    common["args"] = argparse.Namespace(**(vars(common["args"]) | change))
    torch.save(common, path)
    with pytest.raises(MegatronError, match=named):
        import_megatron(save, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert import_megatron(save, tmp_path / "model", no_load_optim=True).iteration == 2


def test_bucket_layout_follows_megatrons_rules():
    """Backward order, 64-element starts, a bucket closed at its size, the tied embedding's pipeline copy in
    a bucket of its own, each end padded to lcm(dp, 128) (which moves the next bucket's start)."""
    from ptdp.megatron.buckets import Bucket, Param, bucket_layout

    params = [Param("embedding", 100, shared_embedding=True), Param("a", 10), Param("b", 70)]
    assert bucket_layout(params, dp=2, bucket_size=None) == [
        Bucket(256, 192, {"b": (0, 70), "a": (128, 138)}), Bucket(128, 100, {"embedding": (0, 100)})]
    assert bucket_layout(params, dp=2, bucket_size=100) == [
        Bucket(256, 138, {"b": (0, 70), "a": (128, 138)}), Bucket(128, 100, {"embedding": (0, 100)})]
    assert bucket_layout(params[1:], dp=3, bucket_size=None) == [Bucket(384, 138, {"b": (0, 70), "a": (128, 138)})]
    assert bucket_layout(params[1:], dp=2, bucket_size=50) == [Bucket(128, 70, {"b": (0, 70)}),
                                                               Bucket(128, 10, {"a": (0, 10)})]


def _with_adam_state(save: Path, **common_changes) -> None:
    """Add a fully_reshardable optimizer state to a torch_dist save: moments 2x and 3x the weights (so
    each maps through the model's own layout), the fp32 weights, Adam at step 10, the scheduler at 80 samples."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    iteration = save / "iter_0000010"
    saved = dcp.FileSystemReader(iteration).read_metadata().state_dict_metadata
    tensors = {k: torch.empty(m.size) for k, m in saved.items() if isinstance(m, TensorStorageMetadata)}
    dcp.load(tensors, checkpoint_id=iteration, no_dist=True)
    for path in [*iteration.glob("*.distcp"), iteration / ".metadata"]:
        path.unlink()
    for key, value in list(tensors.items()):
        tensors[f"optimizer.state.exp_avg.{key}"] = 2 * value
        tensors[f"optimizer.state.exp_avg_sq.{key}"] = 3 * value
        tensors[f"optimizer.state.param.{key}"] = value.clone()
    dcp.save(tensors, checkpoint_id=iteration, no_dist=True)
    common = torch.load(iteration / "common.pt", weights_only=False)
    common["optimizer"] = {"param_state_sharding_type": "fully_reshardable",
                           "optimizer": {"param_groups": [{"step": 10.0}, {"step": 10.0}]}}
    common["opt_param_scheduler"] = {"max_lr": 3e-4, "min_lr": 3e-5, "lr_decay_style": "cosine",
                                     "lr_warmup_steps": 16, "lr_decay_steps": 160, "num_steps": 80,
                                     "start_wd": 0.1, "end_wd": 0.1}
    common.update(common_changes)
    torch.save(common, iteration / "common.pt")


def test_adam_state_maps_like_the_weights_it_belongs_to(tmp_path):
    """Without megatron-core: each moment goes through its parameter's own name and layout mapping (QKV,
    SwiGLU halves, the untied head), the step count is the param groups', the schedule's flags printed."""
    import torch.distributed.checkpoint as dcp

    save = _megatron_save(tmp_path, "llama")
    _with_adam_state(save)
    imported = import_megatron(save, tmp_path / "out")
    weights, _ = read_full_model_state(tmp_path / "out")
    state = {f"optimizer.{name}.{field}": torch.empty(() if field == "step" else value.shape)
             for name, value in weights.items() for field in ("exp_avg", "exp_avg_sq", "step")}
    dcp.load(state, checkpoint_id=imported.path, no_dist=True)
    for name, value in weights.items():
        assert torch.equal(state[f"optimizer.{name}.exp_avg"], 2 * value), name
        assert torch.equal(state[f"optimizer.{name}.exp_avg_sq"], 3 * value), name
        assert float(state[f"optimizer.{name}.step"]) == 10.0
    flags = continue_flags(imported)
    for flag in ("--lr 0.0003", "--min-lr 3e-05", "--lr-decay-style cosine", "--lr-warmup-iters 2",
                 "--lr-decay-iters 20"):
        assert flag in flags, flags


@pytest.mark.parametrize("common, args, named", [
    ({}, {"optimizer": "sgd"}, "optimizer='sgd'"),
    ({}, {"fp16": True}, "fp16=True"),
    ({"opt_param_scheduler": {"num_steps": 72}}, {}, "num_steps 72"),
    ({"optimizer": {"param_state_sharding_type": "dp_zero_gather_scatter"}}, {}, "'dp_zero_gather_scatter'"),
])
def test_adam_state_ptdp_would_not_continue_exactly_is_refused(tmp_path, common, args, named):
    save = _megatron_save(tmp_path, "gpt")
    _with_adam_state(save, **common)
    _edit_args(save, **args)
    with pytest.raises(MegatronError, match=named):
        import_megatron(save, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_torch_format_optimizer_state_without_a_file_per_rank_is_refused(tmp_path):
    """The torch format's distrib_optim.pt holds one model-parallel rank's buffers: one missing (or an
    optimizer other than the distributed one) is refused by name unless --no-load-optim imports the model
    alone."""
    save = _megatron_save(tmp_path, "gpt")
    _split_legacy(save, t=2, p=1)
    torch.save({"per_bucket_numel": []}, save / "iter_0000010" / "mp_rank_00" / "distrib_optim.pt")
    with pytest.raises(MegatronError, match="without a distrib_optim.pt per mp_rank"):
        import_megatron(save, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert import_megatron(save, tmp_path / "model", no_load_optim=True).iteration == 10
