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

ROOT = Path(__file__).resolve().parents[2]
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


# --- The sources cite the repository's own pages, never the project's history or files outside it ------------

REFERENCES = ROOT / "docs" / "references.md"
OUTSIDE = "ptdp" + "-facts"  # a notes file beside the repository (split so this file does not name it)
HISTORY = re.compile(r"\b[Ii]ssues? #?\d+")  # an issue number instead of what the code does
CITATION = re.compile(r"docs/references\.md,? (§[^)]*)")  # up to the citation's closing parenthesis
SECTION = re.compile(r"§(?=[A-Za-z])")
SCANNED = ("ptdp", "benchmarks", "tests", "docs", "examples")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".json", ".toml", ".sbatch", ".txt", ".cfg", ".yaml", ".yml"}


def _sources() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "BENCHMARKS.md"]
    for top in SCANNED:
        files += [p for p in sorted((ROOT / top).rglob("*")) if p.is_file() and p.suffix in TEXT_SUFFIXES]
    return files


def _headings() -> list[str]:
    return [line.lstrip("#").strip() for line in REFERENCES.read_text().splitlines() if line.startswith("#")]


def _bad_sections(text: str, headings: list[str]) -> list[str]:
    """The ``§`` names of ``docs/references.md`` citations in ``text`` that start no heading of the page."""
    flat = re.sub(r"\s+", " ", text)
    bad = []
    for cite in CITATION.finditer(flat):
        span = cite.group(1)[:200]
        for mark in SECTION.finditer(span):
            name = span[mark.end():]
            if not any(name.startswith(h) for h in headings):
                bad.append(name[:40])
    return bad


def test_sources_cite_no_issue_numbers_and_no_outside_notes():
    found = []
    for path in _sources():
        text = path.read_text(errors="replace")
        rel = path.relative_to(ROOT)
        found += [f"{rel}: {OUTSIDE}" for _ in range(OUTSIDE in text)]
        found += [f"{rel}: {m.group(0)!r}" for m in HISTORY.finditer(text)]
    assert not found, "say what the code does, not where it came from:\n" + "\n".join(found)


def test_every_references_citation_names_a_section_of_the_page():
    headings = _headings()
    assert {"Schedules", "Memory", "ZeRO", "Vocabulary parallelism", "Muon"} <= set(headings)
    bad = [f"{p.relative_to(ROOT)}: §{name}" for p in _sources() for name in _bad_sections(p.read_text(errors="replace"), headings)]
    assert not bad, "no such section in docs/references.md:\n" + "\n".join(bad)
    own = re.sub(r"\s+", " ", REFERENCES.read_text())  # the page's own cross-references
    stale = [own[m.end():m.end() + 40] for m in SECTION.finditer(own)
             if not any(own[m.end():].startswith(h) for h in headings)]
    assert not stale, stale


def test_the_citation_check_sees_a_missing_section():
    headings = ["Memory", "Zero-bubble and V schedules"]
    assert _bad_sections("(docs/references.md, §Memory and §Zero-bubble and V schedules)", headings) == []
    assert _bad_sections("(docs/references.md,\n    §Beyond the paper)", headings) == ["Beyond the paper"]
    assert HISTORY.search("the fix (" + "issue" + " 24)") and not HISTORY.search("issues nothing")
