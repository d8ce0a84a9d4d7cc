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
    """Issues 22 and 37: no module imports, directly or not, one that imports it back -- lazy imports inside
    functions and ``typing.TYPE_CHECKING`` imports included (a circle closed only for the types is a circle of
    the design all the same; lint-imports counts them too)."""
    grimp = pytest.importorskip("grimp")  # installed with import-linter (the dev extra)
    graph = grimp.build_graph("ptdp", exclude_type_checking_imports=False)
    assert _cycles(graph) == []
    graph.add_import(importer="ptdp.models", imported="ptdp.cli.main")  # the check sees a cycle when there is one
    assert _cycles(graph)


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
