"""Which tests start processes: how ``pytest -n 2`` shares the suite between two workers.

On a machine of two cores the suite's multi-process tests (launchers, torchrun, the session's pool of
ranks) keep both cores busy, but its in-process tests (schedules, the NCCL model check, the planner,
configuration) use one, and the other waits. With pytest-xdist's ``--dist loadgroup`` every test that
starts processes goes to one group, run in order by one worker (one pool of ranks, one copy of each
session-scoped reference run), while the other worker takes the in-process tests module by module (a
module's fixtures built once). A test counts as starting processes when its function, a fixture it uses,
or a function of its module they call names one of the helpers or modules that start them; when its source
cannot be read it is put with them (the safe side: it then only runs later).
"""

from __future__ import annotations

import inspect
import io
import re
import textwrap
import tokenize
from pathlib import Path

import pytest

PROCESSES = "processes"
_STARTS = re.compile(r"\b(run_layouts|pooled_spawn|spawn|train_metrics|train_run|run_ptdp|run_command|start_command"
                     r"|subprocess|Popen|torchrun|hf_layout_training|hf_family_tests|hf_import|multiprocessing"
                     r"|mp\.spawn|mp\.get_context|_megatron_jobs)\b")
_TESTS = str(Path(__file__).parent)
_NAME = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")


def _code(obj) -> str | None:
    """``obj``'s source without its docstrings, strings and comments (which may name a helper it does not
    call), or None."""
    try:
        text = textwrap.dedent(inspect.getsource(obj))
        return " ".join(token.string for token in tokenize.generate_tokens(io.StringIO(text).readline)
                        if token.type not in (tokenize.STRING, tokenize.COMMENT))
    except (OSError, TypeError, tokenize.TokenError, SyntaxError):
        return None


def _in_tests(obj) -> bool:
    try:
        return (inspect.getsourcefile(obj) or "").startswith(_TESTS)
    except TypeError:
        return False


def starts_processes(item: pytest.Item) -> bool:
    """Whether ``item`` (or a fixture it uses, or a module function they call) starts processes."""
    function = getattr(item, "function", None)
    if function is None:
        return True
    module = getattr(item, "module", None)
    todo = [function]
    infos = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        for definition in (infos.name2fixturedefs.get(name, ()) if infos is not None else ()):
            if _in_tests(definition.func):  # pytest's own fixtures start none
                todo.append(definition.func)
    seen: set[int] = set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        text = _code(inspect.unwrap(obj))
        if text is None:
            return True
        if _STARTS.search(text):
            return True
        for name in set(_NAME.findall(text)):  # the functions and classes of the tests it calls, followed
            called = getattr(module, name, None)
            if (inspect.isfunction(called) or inspect.isclass(called)) and _in_tests(called):
                todo.append(called)
    return False


# Areas whose in-process tests time things (watchdogs, heartbeats, Ctrl-C within seconds): they run beside
# nothing else, in the processes' worker, as they did before the suite was shared.
TIMED_AREAS = ("tests/resilience/", "tests/cli/")


def group_tests(items: list[pytest.Item]) -> None:
    """Mark each item with its xdist group: ``PROCESSES``, or its module for an in-process test."""
    for item in items:
        module = item.nodeid.split("::")[0]
        group = PROCESSES if module.startswith(TIMED_AREAS) or starts_processes(item) else module
        item.add_marker(pytest.mark.xdist_group(group))
