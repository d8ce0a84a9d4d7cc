"""The layering of docs/architecture.md that import-linter cannot state (pyproject.toml holds the rest)."""

from __future__ import annotations

import ast
import functools
import re
import tomllib
from pathlib import Path

import pytest

import ptdp

ROOT = Path(ptdp.__file__).parent


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


@pytest.mark.parametrize("package", ["models", "ops"])
def test_models_import_no_torch_distributed(package):
    """ptdp.models and ptdp.ops run in one process: no torch.distributed (their ptdp imports are checked by
    import-linter, which follows them transitively)."""
    for path in sorted((ROOT / package).glob("*.py")):
        bad = {n for n in _imported(path) if n == "torch.distributed" or n.startswith("torch.distributed.")}
        assert not bad, f"{path.relative_to(ROOT.parent)} imports {sorted(bad)}"


def test_schedules_and_config_import_no_torch():
    """ptdp.schedule and ptdp.config are pure (the launcher, ``ptdp plan`` and ``ptdp simulate`` read them
    without torch); import-linter checks their ptdp imports."""
    for package in ("schedule", "config"):
        for path in sorted((ROOT / package).glob("*.py")):
            bad = {n for n in _imported(path) if n == "torch" or n.startswith("torch.")}
            assert not bad, f"{path.relative_to(ROOT.parent)} imports {sorted(bad)}"


def test_the_command_line_parses_and_refuses_without_torch():
    """``ptdp --help``, a refused flag or configuration, ``ptdp plan`` and ``ptdp simulate`` answer without
    importing torch (seconds of start-up on a busy machine, and in every error-path test that runs the
    command): the parsers, the checks and the planner read no module that loads it."""
    import subprocess
    import sys

    code = ("import sys\nfrom ptdp.cli.main import main\n"
            "codes = [main(['train', '--lr', '-1']), main(['plan', '--model', 'llama3-8b', '--gpus', '8']),"
            " main(['simulate', '--pipeline-model-parallel-size', '2', '--num-microbatches', '4'])]\n"
            "assert codes == [2, 0, 0], codes\n"
            "print('torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT.parent), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "False", "a parser or a check imports torch"


def test_the_check_would_see_an_import(tmp_path):
    """The control: the scan finds both spellings."""
    path = tmp_path / "m.py"
    path.write_text("import torch.distributed as dist\nfrom torch.distributed import all_reduce\n")
    assert {"torch.distributed", "torch.distributed.all_reduce"} <= _imported(path)


def test_no_module_over_400_lines_in_the_architecture_packages():
    for package in ("models", "ops", "parallel", "train", "schedule", "config"):
        for path in (ROOT / package).glob("*.py"):
            assert len(path.read_text().splitlines()) <= 400, path


def _cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), i.e. the import cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycle_anywhere_in_the_package():
    """No module imports, directly or not, one that imports it back -- lazy imports inside
    functions and ``typing.TYPE_CHECKING`` imports included (a circle closed only for the types is a circle of
    the design all the same; lint-imports counts them too)."""
    grimp = pytest.importorskip("grimp")  # installed with import-linter (the dev extra)
    graph = grimp.build_graph("ptdp", exclude_type_checking_imports=False)
    assert _cycles(graph) == []
    graph.add_import(importer="ptdp.models", imported="ptdp.cli.main")  # the check sees a cycle when there is one
    assert _cycles(graph)


# --- Nothing parallel is set on nn.Parameter outside ptdp/parallel/placement.py ----------------------------

# The attributes ptdp used to hang on parameters (and read back with getattr); their successors are the
# fields of ``Placement``, ``DeferredInit`` and ``GradReducer.allocate_main_grad``.
FORMER_PARAMETER_ATTRIBUTES = {
    "tensor_model_parallel", "partition_dim", "sequence_parallel", "expert_parallel", "expert_parallel_size",
    "expert_parallel_rank", "expert_mesh", "expert_shard_dims", "vocab_parallel", "vocab_rows",
    "is_embedding_copy", "grad_norm_owner", "no_weight_decay", "allocate_main_grad", "deferred_init",
}
# What a parameter's __dict__ may hold after set-up and a training step: Megatron's ``main_grad`` (a view of
# the flat gradient buffer) and the zero-bubble weight-gradient store link of ``ptdp.ops.weight_grad``
# (the W pass of zbv/v-half/v-min: runtime plumbing, not placement metadata).
ALLOWED_PARAMETER_ATTRIBUTES = {"main_grad", "_ptdp_weight_grad_store"}
PLACEMENT = ROOT / "parallel" / "placement.py"


def _metadata_writes(path: Path) -> list[str]:
    """Where ``path`` sets (or reads back by name) a former parameter attribute on anything but ``self``, or
    copies one tensor's ``__dict__`` into another's (how attributes used to follow a replaced parameter)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr in FORMER_PARAMETER_ATTRIBUTES and not (
                    isinstance(t.value, ast.Name) and t.value.id == "self"):
                found.append(f"{path.name}:{node.lineno} sets .{t.attr}")
            if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) and t.value.attr == "__dict__":
                found.append(f"{path.name}:{node.lineno} writes a __dict__")
        if isinstance(node, ast.Call):
            fn = node.func
            if (isinstance(fn, ast.Name) and fn.id in ("setattr", "getattr", "hasattr") and len(node.args) > 1
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in FORMER_PARAMETER_ATTRIBUTES):
                found.append(f"{path.name}:{node.lineno} {fn.id}(..., {node.args[1].value!r})")
            if isinstance(fn, ast.Attribute) and fn.attr in ("update", "setdefault") and isinstance(
                    fn.value, ast.Attribute) and fn.value.attr == "__dict__":
                found.append(f"{path.name}:{node.lineno} updates a __dict__")
    return found


def test_no_module_writes_parameter_metadata():
    """The static half: no module of ptdp outside placement.py writes (or probes for) a former parameter
    attribute, or carries attributes from one parameter to another through ``__dict__``."""
    found = [w for path in sorted(ROOT.rglob("*.py")) if path != PLACEMENT for w in _metadata_writes(path)]
    assert not found, found


def test_the_static_check_sees_a_write(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f(param, new, old):\n    param.partition_dim = 0\n    new.__dict__.update(old.__dict__)\n"
                    "    a, param.vocab_rows = 1, (0, 8)\n    return getattr(param, 'no_weight_decay', False)\n"
                    "class L:\n    def __init__(self):\n        self.sequence_parallel = True\n")
    assert len(_metadata_writes(path)) == 4  # not the module's own self.sequence_parallel


def _foreign_attributes(param) -> set[str]:
    return set(param.__dict__) - ALLOWED_PARAMETER_ATTRIBUTES


def test_the_runtime_check_sees_an_attribute():
    import torch

    param = torch.nn.Parameter(torch.zeros(2))
    param.register_hook(lambda grad: None)
    param.register_post_accumulate_grad_hook(lambda p: None)
    param.main_grad = torch.zeros(2)
    assert _foreign_attributes(param) == set()  # torch's own hooks and main_grad are fine
    param.tensor_model_parallel = True
    param.anything_new = 1
    assert _foreign_attributes(param) == {"tensor_model_parallel", "anything_new"}


# Layouts on 4 ranks, each exercising the records of one parallelism (with the TINY model of tests/helpers.py)
_TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "1", "--lr", "1e-3",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
_MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
_P2 = ["--pipeline-model-parallel-size", "2"]
_T2 = ["--tensor-model-parallel-size", "2"]
RECORD_LAYOUTS = {  # name: (flags, what the registry must show on some rank)
    "tp-sp-tied-copy": ([*_T2, *_P2, "--sequence-parallel", "--use-distributed-optimizer", "--bf16"],
                        {"partial_over_tp", "tp", "embedding_copy"}),
    "experts-etp-sp": ([*_MOE, *_T2, "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2",
                        "--sequence-parallel", "--use-distributed-optimizer"],
                       {"expert", "ep", "etp", "partial_over_tp", "norm_owner"}),
    "experts-folded-zbv": ([*_MOE, *_T2, *_P2, "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size",
                            "1", "--pipeline-schedule", "zbv"], {"expert", "ep", "embedding_copy", "norm_owner"}),
    "vocab": ([*_T2, *_P2, "--enable-vocab-parallel", "--use-distributed-optimizer", "--bf16"], {"vocab", "pp", "tp"}),
    "zero3-deferred-tied": ([*_P2, "--data-parallel-sharding-strategy", "optim_grads_params"], {"embedding_copy"}),
}


def _check_records(rank: int, world: int, out: str) -> None:
    import json
    import os
    from unittest import mock

    from ptdp.cli.main import build_parser
    from ptdp.config import config_from_args, derive, validate
    from ptdp.parallel import parallelize
    from ptdp.train.state import setup
    from ptdp.train.step import train_step

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    seen: dict[str, list[str]] = {}
    on_meta: list[tuple[str, set[str]]] = []  # what the apply steps left on the meta parameters

    def checked(make):  # the chunk as the apply steps left it, before materialising makes new parameters
        def wrapper(chunk, *args, **kwargs):
            on_meta.extend((n, _foreign_attributes(p)) for n, p in chunk.named_parameters() if _foreign_attributes(p))
            return make(chunk, *args, **kwargs)
        return wrapper

    for name, (flags, _) in RECORD_LAYOUTS.items():
        config = config_from_args(build_parser().parse_args(["train", *_TINY, *flags]))
        assert not validate(config, world), (name, validate(config, world))
        with mock.patch.object(parallelize, "materialize", checked(parallelize.materialize)), \
                mock.patch.object(parallelize, "defer_init", checked(parallelize.defer_init)):
            trainer = setup(derive(config))
        assert not on_meta, (name, on_meta)
        train_step(trainer, 1)
        assert set(map(id, trainer.placements)) == set(map(id, trainer.params)), name  # no stale record
        kinds = set()
        for chunk in trainer.chunks:
            for pname, param in chunk.named_parameters():
                assert not _foreign_attributes(param), (name, pname, sorted(_foreign_attributes(param)))
                placement = trainer.placements[param]  # every parameter has its record
                kinds.update([placement.role] + [s.axis for s in placement.splits if s.size > 1])
                kinds.update(["partial_over_tp"] if "tp" in placement.partial_over else [])
                kinds.update(["norm_owner"] if placement.norm_owner is not None else [])
        seen[name] = sorted(kinds)
    Path(f"{out}.{rank}").write_text(json.dumps(seen))


def test_parameters_carry_no_parallel_attributes_in_composed_layouts(tmp_path):
    """The runtime half: the apply steps (checked on the meta chunks, before materialising replaces every
    parameter), set-up and one training step in layouts that exercise every kind of record (TP + SP + the
    tied copy, expert + expert-tensor splits, vocabulary slices, ZeRO-3's deferred draws and MoE's norm
    owners) leave nothing on any parameter but ``main_grad``, and every parameter has a placement."""
    import json

    from helpers import pooled_spawn

    pooled_spawn(_check_records, 4, tmp_path, str(tmp_path / "seen"))
    seen = [json.loads((tmp_path / f"seen.{rank}").read_text()) for rank in range(4)]
    for name, (_, expected) in RECORD_LAYOUTS.items():  # the layouts do exercise the records they are for
        assert expected <= set().union(*(set(s[name]) for s in seen)), (name, [s[name] for s in seen])


def _package_layers() -> list[str]:
    """The members of the package's layers contract (the first in pyproject.toml)."""
    contracts = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    return [name.strip() for layer in contracts[0]["layers"] for name in re.split(r"[|:]", layer)]


def test_every_module_has_a_place_in_the_package_layers():
    """A new folder (or a module of a folder split over several layers) must be placed in pyproject.toml's
    first contract: import-linter leaves modules no layer names unchecked."""
    grimp = pytest.importorskip("grimp")
    members = _package_layers()
    assert "ptdp.config" in members and "ptdp.schedule" in members
    placed = lambda module: any(module == m or module.startswith(m + ".") for m in members)  # noqa: E731
    graph = grimp.build_graph("ptdp")
    assert sorted(m for m in graph.modules if not placed(m) and m not in ("ptdp", "ptdp.__main__")) == []
    assert not placed("ptdp.newfolder.module")  # the control


@functools.cache
def _package_text(module: str) -> str | None:
    """The text of ``module``'s ``__init__.py``, or None when it is not a package of this tree."""
    init = ROOT.parent.joinpath(*module.split("."), "__init__.py")
    return init.read_text() if init.exists() else None


def _ptdp_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every ``ptdp`` module an ``import`` names, with ``from ptdp.x import y`` as
    ``ptdp.x.y`` when ``y`` is not a name defined in (or re-exported by) ``ptdp/x/__init__.py``."""
    text, out = path.read_text(), []
    if "ptdp" not in text:
        return out
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "ptdp"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "ptdp":
            names = _package_text(node.module)
            out += [(node.lineno, node.module)]
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                    if names is not None and not re.search(rf"\b{a.name}\b", names)]
    return out


def _exists(module: str) -> bool:
    path = ROOT.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def test_every_ptdp_import_names_a_module_of_this_tree():
    """``from ptdp import flops`` after flops moved to ptdp/models/ still imports in a checkout whose
    editable install points at an older tree (it loads the OLD module from there) and fails in a fresh one:
    every import of ptdp, in the package, the tests and the benchmarks, names a module that exists here."""
    stale = []
    for folder in ("ptdp", "tests", "benchmarks", "examples"):
        for path in sorted(ROOT.parent.joinpath(folder).rglob("*.py")):
            stale += [f"{path.relative_to(ROOT.parent)}:{line} {m}" for line, m in _ptdp_imports(path) if not _exists(m)]
    assert stale == []


def test_the_import_check_would_see_a_moved_module(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from ptdp import flops\nimport ptdp.interrupt\nfrom ptdp.models import flops\n")
    assert [m for _, m in _ptdp_imports(path) if not _exists(m)] == ["ptdp.flops", "ptdp.interrupt"]


def _code_strings(path: Path) -> list[str]:
    """The string constants of a module that are not docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and id(node) not in docstrings]


def test_the_schedules_name_no_flag():
    """ptdp.schedule takes plain numbers and names: the lines that name a flag and its fix are the
    configuration's (``ptdp.config.validate_pipeline``), so a flag renamed or shared by another command
    (``ptdp simulate --num-microbatches``) is spelled in one place."""
    flag = re.compile(r"--[a-z]")
    for path in sorted((ROOT / "schedule").glob("*.py")):
        assert [s for s in _code_strings(path) if flag.search(s)] == [], path
    assert _code_strings(ROOT / "config" / "validate_pipeline.py")  # the control: code strings are seen


def test_validate_touches_no_file(tmp_path):
    """``validate`` is pure: the output directories are created at start-up (``ptdp.runtime.startup``)."""
    from ptdp.config import Config, validate
    from ptdp.runtime.startup import startup_problems

    config = Config()
    config.training.tensorboard_dir, config.training.timeline = str(tmp_path / "tb"), str(tmp_path / "tl")
    validate(config, 1)
    assert list(tmp_path.iterdir()) == []
    startup_problems(config)
    assert (tmp_path / "tl").is_dir()


# -- one door for communication ---------------------------------------------------------------------------

# torch.distributed's communication: its collectives and point-to-point calls. What else it offers manages
# process groups or names types (new_group, get_rank, get_world_size, get_global_rank, get_backend,
# is_initialized, init_process_group, destroy_process_group, ReduceOp, P2POp ...) and is called directly.
COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "broadcast_object_list",
    "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_coalesced", "all_gather_object",
    "gather", "gather_object", "scatter", "scatter_object_list",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
    "send", "recv", "isend", "irecv", "send_object_list", "recv_object_list", "batch_isend_irecv",
    "barrier", "monitored_barrier",
})
# torch's other doors to collectives (functional and autograd-aware ones), which would bypass the recorder
COLLECTIVE_MODULES = ("torch.distributed._functional_collectives", "torch.distributed.nn")
DOOR = ROOT / "observability" / "communication.py"


def _is_torch_distributed(node: ast.expr, aliases: set[str]) -> bool:
    """``dist`` (a name bound to torch.distributed), ``torch.distributed`` or ``torch.distributed.distributed_c10d``."""
    if isinstance(node, ast.Name):
        return node.id in aliases
    if isinstance(node, ast.Attribute) and node.attr == "distributed_c10d":
        return _is_torch_distributed(node.value, aliases)
    return (isinstance(node, ast.Attribute) and node.attr == "distributed" and isinstance(node.value, ast.Name)
            and node.value.id == "torch")


def _raw_communication(path: Path) -> list[str]:
    """Where ``path`` reaches a torch.distributed collective or point-to-point call itself: an attribute
    (``dist.all_reduce(...)``, ``dist.P2POp(dist.isend, ...)``, ``torch.distributed.barrier()``), a
    ``getattr`` of one, an import of one, or an import of torch's functional collectives."""
    tree = ast.parse(path.read_text())
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    label = path.relative_to(ROOT.parent) if path.is_relative_to(ROOT.parent) else path.name
    where = lambda node, what: f"{label}:{node.lineno} {what}"  # noqa: E731
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES and _is_torch_distributed(node.value, aliases):
            found.append(where(node, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and _is_torch_distributed(node.args[0], aliases)
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in COLLECTIVES):
            found.append(where(node, f"getattr {node.args[1].value}"))
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch.distributed", "torch.distributed.distributed_c10d"):
            found += [where(node, f"import {a.name}") for a in node.names if a.name in COLLECTIVES]
        elif isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [where(node, f"import {m}") for m in modules if m.startswith(COLLECTIVE_MODULES)]
    return found


def test_every_collective_goes_through_the_door():
    """Every collective and point-to-point call of ptdp goes through ptdp/observability/communication.py,
    which records it in the flight recorder before issuing it: a call made around it would be invisible
    to the hang watchdog's report. No exception is listed: the door sits in the lowest layer that every
    caller may import (pyproject.toml), the observability's own straggler gather and barrier included."""
    found = [f for path in sorted(ROOT.rglob("*.py")) if path != DOOR for f in _raw_communication(path)]
    assert found == [], f"use ptdp.observability.communication instead: {found}"
    assert _raw_communication(DOOR)  # the door itself is where they are


def test_the_door_check_sees_every_spelling(tmp_path):
    """The control: each way of reaching a collective around the door is found, group management is not."""
    path = tmp_path / "m.py"
    path.write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch import distributed as d2\n"
        "from torch.distributed import all_gather_object, new_group\n"
        "import torch.distributed._functional_collectives as funcol\n"
        "def f(x, g):\n"
        "    dist.all_reduce(x, group=g)\n"
        "    d2.barrier()\n"
        "    torch.distributed.broadcast(x, 0)\n"
        "    ops = [dist.P2POp(dist.isend, x, 1, g)]\n"
        "    getattr(dist, 'reduce_scatter_single', None)\n"
        "    torch.distributed.distributed_c10d.all_to_all_single(x, x)\n"
        "    return dist.get_rank(g), dist.get_world_size(g), dist.new_group([0]), dist.ReduceOp.MAX\n")
    found = [f.split(" ", 1)[1] for f in _raw_communication(path)]
    assert sorted(found) == sorted(["import all_gather_object", "import torch.distributed._functional_collectives",
                                    "all_reduce", "barrier", "broadcast", "isend", "getattr reduce_scatter_single",
                                    "all_to_all_single"])


# GPTModel's attribute names for its pipeline parts: the pipeline split and vocabulary parallelism read the
# model's declaration (``pipeline_parts()``, ``ptdp.models.parts``) instead. ``.mtp`` is looked for as an
# attribute of anything but ``self`` (VocabStage's ``mtp_depth`` is its own count).
_MODEL_PARTS = re.compile(r"\.(final_layernorm|lm_head|embedding_copy|output_layer|word_embeddings|logits)\b"
                          r"|(?<!self)\.mtp\b")
# Recomputation and the assembly reach the layers, the multi-token prediction modules and the methods they
# replace through the declaration too (``ChunkParts.layers``, read as ``parts.layers``, is the declared way);
# the pipeline's cutter of the overlapped pairs' pieces names no attribute of a layer or its blocks either.
_LAYERS = r"|(?<!parts)\.layers\b|(?<!names\.)\brun_layers\b|\blayer_steps\b|\.program\(|\.transformer_layer\b"
_LAYER_PARTS = (r"|\.(attention|mlp|qkv|proj|fc1|fc2|steps|core)\b|(?<!names)\.head\b"
                r"|\b(input_layernorm|post_attention_layernorm|attention_residual|mlp_residual)\b")
_DECLARED_PARTS = {"parallel/pipeline/stage.py": re.compile(rf"{_MODEL_PARTS.pattern}|\.embedding\b"),
                   "parallel/pipeline/parts.py": re.compile(rf"{_MODEL_PARTS.pattern}|\.embedding\b"),
                   "parallel/pipeline/program.py": re.compile(rf"{_MODEL_PARTS.pattern}|\.embedding\b{_LAYERS}"
                                                              rf"{_LAYER_PARTS}"),
                   "parallel/recompute.py": re.compile(rf"{_MODEL_PARTS.pattern}{_LAYERS}{_LAYER_PARTS}"),
                   "parallel/parallelize.py": re.compile(rf"{_MODEL_PARTS.pattern}{_LAYERS}"),
                   "parallel/vocab/stage.py": _MODEL_PARTS}


def _named_parts(path: Path, pattern: re.Pattern) -> list[str]:
    """The lines of ``path`` that name a part by GPTModel's attribute (imports name modules: skipped)."""
    return [f"{path.name}:{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
            if pattern.search(line) and not line.startswith(("from ", "import "))]


@pytest.mark.parametrize("module", sorted(_DECLARED_PARTS))
def test_the_pipeline_and_vocabulary_stages_read_the_declared_parts(module):
    """The pipeline split and the vocabulary-parallel stage reach a chunk's embedding, final norm, output
    layer and copies through the model's declared pipeline parts, never by GPTModel's attribute names: a
    model family that names its parts otherwise is split and vocabulary-split the same."""
    assert _named_parts(ROOT / module, _DECLARED_PARTS[module]) == []


def test_the_declared_parts_check_sees_a_name(tmp_path):
    """The control: the lines the stages were written with before the declaration are found."""
    path = tmp_path / "m.py"
    path.write_text("from ptdp.models.mtp import ShiftLabels\n"
                    "chunk.final_layernorm = chunk.lm_head = chunk.mtp = None\nx = self.mtp\n"
                    "chunk.embedding_copy.word_embeddings = p\nchunk.output_layer.weight\ny = chunk.embedding\n")
    assert len(_named_parts(path, _MODEL_PARTS)) == 3
    assert len(_named_parts(path, _DECLARED_PARTS["parallel/pipeline/stage.py"])) == 4


def test_the_declared_layers_check_sees_a_name(tmp_path):
    """The control: the lines recomputation, the assembly and the pieces were written with before the
    declaration are found, and the declared ways (``parts.layers``, ``names.head``) are not."""
    path = tmp_path / "m.py"
    path.write_text("mtp = [] if model.mtp is None else list(model.mtp.layers.values())\n"
                    "model.run_layers = functools.partial(_run_planned, plan)\n"
                    "model.layer_steps = functools.partial(_checkpoint_steps, recomputed)\n"
                    "compile_layers(chunk.layers.values(), shape, dtype)\n"
                    "steps, name = self.chunks[chunk].program(INPUT)\n"
                    "steps += layer.steps(x, out)\n"
                    "layer.attention.core = functools.partial(_maybe_checkpoint, layer.attention.core)\n"
                    "for key, layer in parts.layers.items(): head = getattr(chunk, parts.names.head)\n")
    assert len(_named_parts(path, _DECLARED_PARTS["parallel/parallelize.py"])) == 5
    assert len(_named_parts(path, _DECLARED_PARTS["parallel/recompute.py"])) == 7


# What the overlapped pairs' cutting used to keep in the plain model: the pipeline cuts now
# (``ptdp.parallel.pipeline.program``), where the model declares it may (``PipelineParts.cuts``).
_CUT_MACHINERY = {"entry", "exit", "local", "after", "program", "layer_steps", "_cut", "_cut_half",
                  "_attention_steps"}


def _cut_machinery(path: Path) -> list[str]:
    return [f"{path.name}:{node.lineno}: def {node.name}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in _CUT_MACHINERY]


def test_the_plain_models_keep_no_cut_machinery():
    """The plain model says where a layer may be cut (data); it defines no function that cuts it, nor a
    communication seam on its linears: those are the pipeline's and the parallelisms'."""
    found = [line for path in sorted((ROOT / "models").rglob("*.py")) for line in _cut_machinery(path)]
    assert found == []
    gpt = ast.parse((ROOT / "models" / "gpt.py").read_text())
    layer = next(n for n in gpt.body if isinstance(n, ast.ClassDef) and n.name == "TransformerLayer")
    assert "steps" not in {n.name for n in layer.body if isinstance(n, ast.FunctionDef)}


def test_the_cut_machinery_check_sees_a_method(tmp_path):
    """The control: the plain linear's former seam is found."""
    path = tmp_path / "m.py"
    path.write_text("class Linear:\n    def entry(self):\n        return None\n"
                    "    def local(self, x):\n        return x\n\n\ndef _cut_half(norm):\n    pass\n")
    assert len(_cut_machinery(path)) == 3
