"""The architecture's plug-in rule for the step: the executor, the training step and evaluation name no
parallelism and probe nothing; what each parallelism adds comes from ``ptdp.parallel.assembly`` (handlers,
stage factory, gradient syncs, step hooks). A new ``if <feature>`` in these files fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import ptdp

ROOT = Path(ptdp.__file__).parent
FILES = ["parallel/pipeline/executor.py", "parallel/pipeline/handlers.py", "parallel/pipeline/module_stage.py",
         "train/step.py", "train/evaluate.py"]
# words of identifiers (split at "_" and capitals) that name a parallelism or a feature of one
FEATURES = {"vocab", "zero", "moe", "expert", "experts", "embedding", "embeddings", "tied", "sp", "tp", "cp", "dp",
            "ep", "shard", "sharded", "sharding", "gather", "aux", "router"}


def _words(identifier: str) -> set[str]:
    return {w.lower() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+", identifier)}


def _named(tree: ast.AST) -> set[str]:
    return {ident for ident in _identifiers(tree) if FEATURES & _words(ident)}


def _identifiers(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.update(node.name.split("."))
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
    return names


@pytest.mark.parametrize("name", FILES)
def test_the_step_and_the_executor_name_no_parallelism(name):
    tree = ast.parse((ROOT / name).read_text())
    named = _named(tree)
    assert not named, f"ptdp/{name} names a parallelism: {sorted(named)} (register a handler, a grad sync or a " \
                      "step hook in ptdp.parallel.assembly instead)"
    probes = [node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr")]
    assert not probes, f"ptdp/{name} probes objects: {probes} (the protocols say what they have)"


def test_the_check_sees_a_feature_branch():
    """The check itself can fail: the step as it was before the plug-ins (a VocabStage branch, MoE statistics)."""
    before = "if barriers:\n    stage = VocabStage(chunks)\nmoe = gather_moe_stats(trainer)\n"
    assert _named(ast.parse(before)) == {"VocabStage", "gather_moe_stats", "moe"}
