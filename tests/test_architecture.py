"""The layering of docs/architecture.md that import-linter cannot state (pyproject.toml holds the rest)."""

from __future__ import annotations

import ast
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
    """Issue 22: no module imports, directly or not, one that imports it back -- lazy imports inside
    functions included (``typing.TYPE_CHECKING`` imports, never executed, excluded as lint-imports does)."""
    grimp = pytest.importorskip("grimp")  # installed with import-linter (the dev extra)
    graph = grimp.build_graph("ptdp", exclude_type_checking_imports=True)
    assert _cycles(graph) == []
    graph.add_import(importer="ptdp.models", imported="ptdp.cli.main")  # the check sees a cycle when there is one
    assert _cycles(graph)
