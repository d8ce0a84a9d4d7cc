"""Draw ptdp's package structure as a Mermaid diagram: one box per top-level module or subpackage, grouped
by the layers of the import-linter contract in pyproject.toml, one arrow per "imports from" (module-level
and function-level imports alike; TYPE_CHECKING imports left out, as the contract leaves them out).

    python docs/package_graph.py > docs/architecture-after.md

The diagram is read from the code each time, so it shows the structure as it is, not as intended: an arrow
that points up a layer is a real import (the contract, run by ``lint-imports``, says which are allowed).
"""

from __future__ import annotations

import ast
import tomllib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ptdp"


def unit(module: str) -> str:
    """The box a module belongs to: ``ptdp.x`` for ``ptdp.x`` and everything under it."""
    return ".".join(module.split(".")[:2])


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports(path: Path) -> list[str]:
    """The ptdp modules ``path`` imports (relative imports resolved)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    found = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found += [base] if base != package else [f"{base}.{a.name}" for a in node.names]
    return [m for m in found if m == "ptdp" or m.startswith("ptdp.")]


def edges() -> Counter:
    counts: Counter = Counter()
    for path in sorted(PACKAGE.rglob("*.py")):
        source = unit(module_name(path))
        for target in map(unit, imports(path)):
            if target not in (source, "ptdp"):
                counts[(source, target)] += 1
    return counts


def layers() -> list[list[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contract = next(c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers")
    return [[m.strip() for m in layer.split(":")] for layer in contract["layers"]]


def mermaid() -> str:
    counts = edges()
    boxes = sorted({b for pair in counts for b in pair})
    layered = layers()
    in_layer = {m for layer in layered for m in layer}
    ident = {b: b.replace("ptdp.", "").replace(".", "_") for b in boxes}
    lines = ["flowchart TD"]
    for i, layer in enumerate(layered):
        lines.append(f'  subgraph L{i}["layer {i + 1}: {" / ".join(m.removeprefix("ptdp.") for m in layer)}"]')
        lines += [f'    {ident[m]}["{m.removeprefix("ptdp.")}"]' for m in layer if m in ident]
        lines.append("  end")
    lines.append('  subgraph beside["beside the stack (read by every layer), and the commands"]')
    lines += [f'    {ident[b]}["{b.removeprefix("ptdp.")}"]' for b in boxes if b not in in_layer]
    lines.append("  end")
    lines += [f"  {ident[a]} --> {ident[b]}" for (a, b) in sorted(counts)]
    return "\n".join(lines)


if __name__ == "__main__":
    print("# ptdp's package structure after the architecture work (issue 22)\n")
    print("Generated from the code by `python docs/package_graph.py > docs/architecture-after.md`: one box per "
          "top-level module or subpackage of `ptdp/`, grouped by the layers that `lint-imports` checks "
          "(pyproject.toml), an arrow for each \"imports from\". See docs/architecture.md for what each "
          "layer holds.\n")
    print("```mermaid")
    print(mermaid())
    print("```")
