"""docs/architecture.md is true of the code: every path and every ``ptdp.module.name`` it names exists; so
is every other page of docs/ and the README.

The page is the map for whoever adds the next parallelism; a name that moved or vanished makes it lie. The
check is static (the source's definitions, read with ``ast``): a dotted name resolves to its longest module
prefix (``ptdp/x/y.py`` or a package), then each further part to a top-level definition of that module
(function, class, assignment, import) or a member of the class before it (method, property, field).
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
CODE = re.compile(r"`([^`]+)`")  # inline code spans
PATH = re.compile(r"\b(?:ptdp|tests|docs|benchmarks)/[\w./-]*")
DOTTED = re.compile(r"\bptdp(?:\.\w+)+")
FILE_NAMES = {"ptdp.json", "ptdp.sbatch"}  # the pages' example files, named like a module


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _names(scope: ast.Module | ast.ClassDef) -> dict[str, ast.AST]:
    """What a module or class defines, by name (functions, classes, assignments, imports; a class's
    ``self.x = ...`` in its methods too)."""
    out: dict[str, ast.AST] = {}
    if isinstance(scope, ast.ClassDef):
        for node in ast.walk(scope):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                            and target.value.id == "self":
                        out[target.attr] = node
    for node in scope.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        out[name.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                out[alias.asname or alias.name.split(".")[0]] = node
    return out


def exists(dotted: str) -> bool:
    """Whether ``ptdp.a.b.name[.member]`` is defined in the source tree."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = _module_file(parts[:cut])
        if path is not None:
            break
    else:
        return False
    node: ast.AST = _tree(path)
    for part in parts[cut:]:
        if not isinstance(node, (ast.Module, ast.ClassDef)):
            return False
        node = _names(node).get(part)
        if node is None:
            return False
    return True


def missing(text: str) -> tuple[list[str], int]:
    """The paths and dotted names in ``text``'s code spans that do not exist, and how many were checked."""
    checked, bad = set(), []
    for span in CODE.findall(text):
        for path in PATH.findall(span):
            path = path.rstrip(".")
            checked.add(path)
            if not (ROOT / path).exists():
                bad.append(path)
        for dotted in DOTTED.findall(span):
            dotted = dotted.rstrip(".")
            if dotted in FILE_NAMES:
                continue
            checked.add(dotted)
            if not exists(dotted):
                bad.append(dotted)
    return sorted(set(bad)), len(checked)


def test_every_name_in_the_architecture_page_exists():
    bad, checked = missing(DOC.read_text())
    assert not bad, f"docs/architecture.md names what the code does not have: {bad}"
    assert checked > 100, checked  # the page names the code it describes: the check has something to check


def test_every_name_in_the_other_pages_exists():
    pages = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    bad = {page.name: missing(page.read_text())[0] for page in pages if page != DOC}
    bad = {name: names for name, names in bad.items() if names}
    assert not bad, f"pages name what the code does not have (moved or renamed?): {bad}"


def test_the_check_sees_a_stale_name():
    text = ("`ptdp/parallel/parallelize.py`, `ptdp/parallel/tensor_parallel.py`, "
            "`ptdp.parallel.parallelize.build_model_chunks(plan, ...)`, `ptdp.optim.grad_buffer.GradBuckets`, "
            "`ptdp.parallel.assembly.Assembly.make_stage`, `ptdp.parallel.assembly.Assembly.no_such_member`, "
            "`ptdp.parallel.plan.ParallelPlan.defer_init`, `ptdp.parallel.dims.ParallelState.tp_group`, "
            "`ptdp.parallel.dims.ParallelState.tp_rank.real`")
    bad, checked = missing(text)
    assert checked == 9
    assert bad == ["ptdp.optim.grad_buffer.GradBuckets", "ptdp.parallel.assembly.Assembly.no_such_member",
                   "ptdp.parallel.dims.ParallelState.tp_rank.real", "ptdp/parallel/tensor_parallel.py"]
