"""CPU a ptdp process spends to start, against another tree of ptdp (BENCHMARKS.md, "Process start-up").

    git -C . archive <base> | tar -x -C /tmp/base
    python benchmarks/startup.py --base /tmp/base --repeats 5

Three measurements, each run ``--repeats`` times alternating the base tree and this one (so both see the same
load), user + sys CPU time of the process and everything it waited for, medians:

- ``import``: ``python -c "import ptdp.train.loop, ptdp.checkpointing.full_model"`` (``import torch`` alone
  for scale);
- ``train``: ``ptdp train --nproc-per-node 2`` of a tiny GPT, 2 iterations and a save: the launcher and its
  two workers;
- ``launcher``: the launcher process of that run alone (its own CPU, its workers not counted).

CPU time, not wall: on a shared machine the wall is mostly other people's work. Prints one line per
measurement and tree, and the new/base ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1"]

# ``python -m ptdp`` whose launcher prints its own CPU (RUSAGE_SELF: not its workers') before it leaves.
LAUNCHER = """
import resource, sys
import ptdp.cli.main as cli
leave = cli.exit_now
def report_then_leave(code=0):
    r = resource.getrusage(resource.RUSAGE_SELF)
    print(f"LAUNCHER_CPU {r.ru_utime + r.ru_stime:.4f}", flush=True)
    leave(code)
cli.exit_now = report_then_leave
sys.argv = ["ptdp", *sys.argv[1:]]
cli.main()
"""


def _run(command: list[str], tree: Path, cwd: Path) -> tuple[float, str]:
    """(user + sys CPU seconds of ``command`` and the processes it waited for, its stdout), run on ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(command[:4])} ... on {tree} failed ({proc.returncode}):\n{out[-3000:]}")
    return usage.ru_utime + usage.ru_stime, out


def measure(tree: Path) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)  # not the tree: ``python -m`` would import ptdp from the working directory
        torch_s, _ = _run([sys.executable, "-c", "import torch"], tree, cwd)
        import_s, _ = _run([sys.executable, "-c", "import ptdp.train.loop, ptdp.checkpointing.full_model"], tree, cwd)
        train_s, out = _run([sys.executable, "-c", LAUNCHER, "train", *TINY, "--nproc-per-node", "2",
                             "--save", str(cwd / "ckpt"), "--save-interval", "2"], tree, cwd)
    launcher_s = float(next(line.split()[1] for line in out.splitlines() if line.startswith("LAUNCHER_CPU")))
    return {"import torch": torch_s, "import": import_s, "train": train_s, "launcher": launcher_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the ptdp tree to compare against")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    trees = {"base": args.base.resolve(), "new": HERE}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(args.repeats):
        for name, tree in trees.items():
            runs[name].append(measure(tree))
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    if args.json:
        print(json.dumps({"medians": medians, "runs": runs}, indent=1))
        return
    for key in medians["base"]:
        base, new = medians["base"][key], medians["new"][key]
        print(f"{key:>13}: base {base:6.2f} s  new {new:6.2f} s  new/base {new / base:.2f}  "
              f"(base runs {[round(r[key], 2) for r in runs['base']]}, new {[round(r[key], 2) for r in runs['new']]})")


if __name__ == "__main__":
    main()
