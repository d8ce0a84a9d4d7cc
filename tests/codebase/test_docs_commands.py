"""Every fenced ``ptdp ...`` command of README.md and docs/*.md works as written.

Three tiers, so the whole file stays within about a minute on two cores:

* every command is parsed by the real ``ptdp`` parser (an unknown flag, a wrong choice, a stale spelling
  fails) and checked as its command checks it before starting: ``ptdp train`` through
  ``config_from_args`` + ``validate`` at the world size it launches (``--nproc-per-node`` x nodes, or
  torchrun's), ``ptdp simulate`` run whole (milliseconds), ``ptdp plan`` through its model / cluster
  checks; the files a command names are not required here;
* a representative subset runs end to end in one sandbox, in the README's order, iterations shrunk
  (``shrink``): the README's set-up job (8 processes, t = 2) and ``generate`` from its checkpoint, the
  BPE ``preprocess``, the schedule picture, a Mixtral ``plan``, the uneven pipeline layout of
  docs/pipeline-layout.md (4 processes);
* a ``$ ptdp ...`` example followed by its output prints exactly those lines.

``PTDP_DOCS_RUN_ALL=1`` runs every runnable command in the sandbox instead of the subset (minutes), each
needing inputs the sandbox does not make is skipped naming them. ``CANNOT_RUN_ON_CPU`` lists the commands
that are only checked, with the reason.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import _OWN_PROCESS_FLAGS, _run_layouts, finish_command, pooled_spawn, worker_env

from ptdp.cli.main import build_parser, main
from ptdp.cli.parser import parse

ROOT = Path(__file__).resolve().parents[2]
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
RUN_ALL = os.environ.get("PTDP_DOCS_RUN_ALL") == "1"

# Commands that cannot run on a CPU machine, by a fragment of their text: checked (parsed, validated) only.
CANNOT_RUN_ON_CPU = {
    "--rdzv-endpoint HEAD:29400": "a multi-node job: needs the nodes that meet at HEAD:29400",
    "--model llama3-8b --load ckpt": "Llama-3-8B: 16 GB of 16-bit weights, a GPU cluster's model",
    "--tensor-model-parallel-size 8 --nproc-per-node 8 --nnodes 32": "256 processes (32 nodes of 8)",
}
# Output lines inside a block ("ptdp train: error: ...", "picture: ptdp simulate ..."): not commands.
_OUTPUT = re.compile(r"^ptdp( [a-z]+)?:")


@dataclass(frozen=True)
class DocCommand:
    where: str  # FILE:LINE
    text: str  # as written, continuation lines joined
    argv: tuple[str, ...]  # the arguments after ``ptdp``, placeholders ("...", "[--optional]") removed
    launch: tuple[str, ...] = ()  # torchrun's flags when the docs start ptdp through torch.distributed.run
    output: tuple[str, ...] = ()  # the lines a "$ ptdp ..." example shows after it

    @property
    def synopsis(self) -> bool:
        """A usage synopsis ("a.jsonl[,b.parquet]", "[--tokenizer {byte,bpe}]"), not a command to run."""
        return any(("[" in a and not a.startswith("[")) or a in ("|", "{byte,bpe}") or "{" in a for a in self.argv)

    @property
    def cannot_run(self) -> str | None:
        return next((why for fragment, why in CANNOT_RUN_ON_CPU.items() if fragment in self.text), None)

    def __str__(self) -> str:
        return self.where


def _blocks(text: str):
    """(first line number, lines) of every fenced block, and of indented blocks' "$ ptdp" lines."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            yield i + 2, lines[i + 1:j]
            i = j + 1
            continue
        if lines[i].startswith("    $ ptdp"):
            yield i + 1, [lines[i].strip()]
        i += 1


def _command(line: str) -> tuple[str, tuple[str, ...]] | None:
    """(the ptdp part, torchrun's flags) of a line that runs ptdp, or None."""
    line = line.strip().removeprefix("$ ")
    if " -m ptdp " in line:  # python -m torch.distributed.run ... -m ptdp train ...
        launcher, command = line.split(" -m ptdp ", 1)
        return "ptdp " + command, tuple(shlex.split(launcher))
    if "&& ptdp " in line:
        line = line[line.rindex("&& ptdp ") + 3:]
    if not line.startswith("ptdp ") or _OUTPUT.match(line):
        return None
    return line, ()


def doc_commands() -> list[DocCommand]:
    found = []
    for doc in DOCS:
        for start, block in _blocks(doc.read_text()):
            joined, first = [], []  # continuation lines joined, each with its first line number
            for k, line in enumerate(block):
                if joined and joined[-1].rstrip().endswith("\\"):
                    joined[-1] = joined[-1].rstrip()[:-1].rstrip() + " " + line.strip()
                else:
                    joined.append(line)
                    first.append(start + k)
            for k, line in enumerate(joined):
                hit = _command(line)
                if hit is None:
                    continue
                text, launch = hit
                words = shlex.split(text.split(" | ")[0], comments=True)[1:]
                argv = tuple(w for w in words if w != "..." and not (w.startswith("[") and w.endswith("]")))
                output = ()
                if line.lstrip().startswith("$ "):
                    output = tuple(joined[k + 1:k + 1 + next((j for j, x in enumerate(joined[k + 1:])
                                                              if x.lstrip().startswith("$ ")), len(joined))])
                found.append(DocCommand(f"{doc.name}:{first[k]}", text, argv, launch, output))
    return found


COMMANDS = doc_commands()


def test_the_docs_have_their_commands():
    """The extraction itself: the README's set-up line, torchrun's form, a "$" example and a synopsis."""
    texts = [c.text for c in COMMANDS]
    assert len(COMMANDS) >= 40
    assert any(t.startswith("ptdp train --nproc-per-node 8 --tensor-model-parallel-size 2 --train-iters 200")
               for t in texts)
    assert any(c.launch for c in COMMANDS) and any(c.output for c in COMMANDS) and any(c.synopsis for c in COMMANDS)


def _world(c: DocCommand) -> tuple[list[int], int]:
    """(world sizes the launch may have, processes per node), as ``ptdp train``'s launcher or torchrun."""
    flags = {a: b for a, b in zip(c.launch, c.launch[1:]) if a.startswith("--") and not b.startswith("--")}
    argv = list(c.argv)
    nproc = flags.get("--nproc-per-node") or (argv[argv.index("--nproc-per-node") + 1]
                                              if "--nproc-per-node" in argv else "1")
    nodes = flags.get("--nnodes") or (argv[argv.index("--nnodes") + 1] if "--nnodes" in argv else "1")
    low, high = (int(x) for x in (nodes.split(":") * 2)[:2])
    return [n * int(nproc) for n in range(low, high + 1)], int(nproc)


@pytest.mark.parametrize("command", [c for c in COMMANDS if not c.synopsis and not c.output], ids=str)
def test_every_command_parses_and_validates(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = list(command.argv)
    if argv and argv[0] == "--version":
        return  # argparse's own action (exit 0); run in the representative subset
    args = parse(build_parser(), argv)  # an unknown flag or choice: SystemExit(2) with one line
    if args.command == "train":
        from ptdp.config import config_from_args, validate

        config = config_from_args(args)
        worlds, per_node = _world(command)
        problems = [validate(config, w, per_node) for w in worlds]
        assert any(not p for p in problems), f"{command.where}: {problems[0]}"
    elif args.command == "simulate":
        if args.out:
            args.out = str(tmp_path / Path(args.out).name)
        if args.comm_trace:
            args.comm_trace = str(tmp_path / Path(args.comm_trace).name)
        assert args.run(args) == 0, capsys.readouterr().err
    elif args.command == "plan":
        from ptdp.planner.command import _setup

        _setup(args)  # the model, the cluster and the flags; the search itself runs in the subset


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.output], ids=str)
def test_examples_print_what_the_docs_show(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    try:
        code = main(list(command.argv))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    shown = [line for line in command.output if line.strip()]
    assert (out.out + out.err).splitlines() == shown and code == (2 if any("error:" in s for s in shown) else 0)


def shrink(argv: list[str]) -> list[str]:
    """The command with its iterations shrunk for a CPU test: ``--train-iters 2``, evaluation and saves
    within them, a progress line each, ``--max-new-tokens 4``; and for a big model on a CPU (only under
    ``PTDP_DOCS_RUN_ALL``) sequences of at most 64 tokens. Everything else as written."""
    out, limits = list(argv), {"--eval-interval": 2, "--eval-iters": 1, "--save-interval": 2, "--log-interval": 1,
                               "--max-new-tokens": 4, "--seq-length": 64}
    for flag, most in limits.items():
        if flag in out:
            i = out.index(flag) + 1
            out[i] = str(min(int(out[i]), most))
    if out[:1] == ["train"]:
        if "--train-iters" in out:
            out[out.index("--train-iters") + 1] = "2"
        else:
            out += ["--train-iters", "2"]
    return out


def _sandbox(root: Path) -> None:
    """The inputs the docs' commands name: a JSONL corpus (data/corpus is preprocessed from it by the
    README's own command)."""
    docs = [{"text": f"def f{k}(x):\n    return x * {k} + {k % 7}\n" * (3 + k % 5)} for k in range(400)]
    import json

    (root / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))


def _after_preprocess(root: Path) -> None:
    for name in ("code", "held-out", "a", "b"):  # the README's blends name more datasets: copies of one
        for suffix in (".bin", ".idx", ".tokenizer.json"):
            if (root / "data" / f"corpus{suffix}").exists():
                shutil.copy(root / "data" / f"corpus{suffix}", root / "data" / f"{name}{suffix}")


def _train_in(rank: int, world_size: int, root: str, plan: list) -> None:
    """``helpers._run_layouts`` with the sandbox as the working directory (the docs' paths are relative)."""
    cwd = os.getcwd()
    os.chdir(root)
    try:
        _run_layouts(rank, world_size, root, plan)
    finally:
        os.chdir(cwd)


def _run(command: DocCommand, root: Path) -> None:
    """``python -m ptdp ARGV`` in the sandbox, shrunk, to completion (a timeout kills its process group).

    A single-node ``ptdp train --nproc-per-node N`` trains in N ranks of the session's pool instead: the
    same ``train()`` each launched worker runs, without starting Python and torch in N + 1 processes (most
    of this test's time); the launcher is tested by the tests of the command line."""
    argv = shrink(list(command.argv))
    flags = {a.split("=")[0] for a in argv}
    if argv[:1] == ["train"] and "--nproc-per-node" in argv and flags & _OWN_PROCESS_FLAGS == {"--nproc-per-node"}:
        i = argv.index("--nproc-per-node")
        world, rest = int(argv[i + 1]), argv[1:i] + argv[i + 2:]
        pooled_spawn(_train_in, world, root, str(root), [(f"docs-{os.urandom(4).hex()}", world, rest)],
                     timeout=600)
        return
    proc = subprocess.Popen([sys.executable, "-m", "ptdp", *argv], cwd=root, env=worker_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    result = finish_command(proc, timeout=600)
    assert result.returncode == 0, f"{command.where}: ptdp {' '.join(argv)}\n{result.stderr[-3000:]}"


def _find(where_prefix: str, starts: str) -> DocCommand:
    return next(c for c in COMMANDS if c.where.startswith(where_prefix) and c.text.startswith(starts))


REPRESENTATIVE = [  # (file, how the command starts): the README's order, inputs before their readers
    ("README.md", "ptdp preprocess --input corpus.jsonl"),
    ("README.md", "ptdp train --nproc-per-node 8 --tensor-model-parallel-size 2 --train-iters 200"),
    ("README.md", "ptdp generate --load ckpt"),
    ("README.md", "ptdp simulate --pipeline-schedule interleaved --pipeline-model-parallel-size 4 "
                  "--virtual-pipeline-model-parallel-size 2 --num-microbatches 8 --out"),
    ("README.md", "ptdp plan --model mixtral-8x7b"),
    ("README.md", "ptdp --version"),
    ("pipeline-layout.md", "ptdp train --nproc-per-node 4 --num-layers 8 --pipeline-model-parallel-size 4 "
                           "--pipeline-model-parallel-layout"),
]


def _needs(command: DocCommand, root: Path) -> list[str]:
    """Inputs a command reads that the sandbox does not hold (checked by name: the docs' placeholders)."""
    argv = list(command.argv)
    wanted = [argv[argv.index(f) + 1] for f in ("--load", "--in", "--input", "--tokenizer-model") if f in argv]
    wanted += [w for f in ("--data-path", "--train-data-path", "--valid-data-path") if f in argv
               for w in argv[argv.index(f) + 1:] if w.startswith("data/")]
    if argv[:1] == ["timeline"]:
        wanted.append(argv[-1])
    return [w for w in wanted if not any((root / w).parent.glob(Path(w).name + "*"))]


@pytest.mark.skipif(sys.platform != "linux", reason="launches CPU workers")
def test_representative_commands_run(tmp_path):
    _sandbox(tmp_path)
    plan = COMMANDS if RUN_ALL else [_find(f, s) for f, s in REPRESENTATIVE]
    skipped = []
    for command in plan:
        if command.synopsis or command.output or command.cannot_run:
            continue
        missing = _needs(command, tmp_path)
        if missing:
            skipped.append(f"{command.where}: needs {', '.join(missing)}")
            continue
        _run(command, tmp_path)
        if command.argv[:1] == ("preprocess",):
            _after_preprocess(tmp_path)
    if RUN_ALL:
        print("\n".join(["skipped (inputs the sandbox does not make):", *skipped]))
    else:
        assert not skipped, skipped
    assert (tmp_path / "ckpt" / "latest").exists() and (tmp_path / "schedule.svg").exists()
