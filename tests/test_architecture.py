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
