"""``--timeline DIR``: per-rank Chrome traces of the first ``--timeline-iters`` iterations.

Each rank writes ``DIR/rank{N}.json`` (``{"traceEvents": [...]}``, opened by https://ui.perfetto.dev or
chrome://tracing) with one complete event (``"ph": "X"``) per forward and per backward of every
(microbatch, chunk) pair, per wait on a pipeline receive/send, and per collective of the step (DP
gradient all-reduce, embedding sync, grad-norm, optimizer step). Rank 0 merges them into
``DIR/merged.json`` with ``pid`` = rank, so the pipeline bubble of docs/references.md, §Schedules is visible
as the gaps between a rank's compute events; ``ptdp timeline merge DIR`` redoes the merge by hand.

Timestamps are wall-clock microseconds (``time.time`` anchored to ``perf_counter``), so the ranks of one
machine line up exactly and those of several nodes as well as their clocks agree. On a CUDA device the
events are CUDA events (``ptdp.observability.clock``): the host only launches the work, so host times would
show launches, not the GPU's work; they are read when the trace is saved, anchored to the wall clock by
one event recorded beside a host timestamp.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from ptdp.observability.clock import Clock, seconds

# One row ("thread") per kind of work, so compute and waiting never overlap on one row.
THREADS = {"compute": 0, "p2p": 1, "collective": 2}
MERGED = "merged.json"


def rank_file(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.json"


class Timeline:
    """Events of one rank; records only while an iteration in ``[first, first + iterations)`` runs.

    ``record`` is the callback the pipeline executor takes (``run_schedule(..., recorder=...)``):
    ``record(name, category, start, end, args)`` with ``perf_counter`` seconds or CUDA events.
    """

    def __init__(self, directory: str | Path, rank: int, iterations: int = 3, first_iteration: int = 1,
                 device: object = "cpu"):
        self.directory, self.rank = Path(directory), rank
        self.first, self.last = first_iteration, first_iteration + iterations - 1
        self.iteration: int | None = None
        self.events: list[dict] = []
        self._wall_offset_us = (time.time() - time.perf_counter()) * 1e6
        self.clock = Clock(device)
        self._anchor: tuple[object, float] | None = None  # (CUDA event, perf_counter at its record)

    @property
    def active(self) -> bool:
        return self.iteration is not None and self.first <= self.iteration <= self.last

    def begin_iteration(self, iteration: int) -> None:
        self.iteration = iteration

    def record(self, name: str, category: str, start, end, args: dict | None = None) -> None:
        """One event from ``start`` to ``end``: ``perf_counter`` seconds, or CUDA events (read at save)."""
        if not self.active:
            return
        if not isinstance(start, int | float) and self._anchor is None:
            self._anchor = (self.clock.mark(), time.perf_counter())
        self.events.append({
            "name": name, "cat": category, "ph": "X", "pid": self.rank, "tid": THREADS.get(category, 0),
            "ts": start, "dur": end, "args": {"iteration": self.iteration, **(args or {})},
        })

    def _resolved(self) -> list[dict]:
        """The events with their times in wall-clock microseconds (CUDA events read now)."""
        out = []
        for event in self.events:
            start, end = event["ts"], event["dur"]
            if not isinstance(start, int | float):  # CUDA events: seconds after the anchor event
                anchor, host = self._anchor
                start_s = host + seconds(anchor, start)
                end, start = start_s + seconds(start, end), start_s
            out.append({**event, "ts": round(start * 1e6 + self._wall_offset_us, 3),
                        "dur": round((end - start) * 1e6, 3)})
        return out

    @contextmanager
    def span(self, name: str, category: str = "collective", **args) -> Iterator[None]:
        start = self.clock.mark()
        try:
            yield
        finally:
            self.record(name, category, start, self.clock.mark(), args)

    def save(self) -> Path:
        path = rank_file(self.directory, self.rank)
        self.directory.mkdir(parents=True, exist_ok=True)
        _write_json(path, {"traceEvents": _metadata(self.rank) + self._resolved(), "displayTimeUnit": "ms"})
        return path


def span(timeline: Timeline | None, name: str, category: str = "collective", **args):
    """``timeline.span(...)`` or a no-op when the run has no ``--timeline``."""
    return nullcontext() if timeline is None else timeline.span(name, category, **args)


def _metadata(rank: int) -> list[dict]:
    events = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
              {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}}]
    events += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}}
               for name, tid in THREADS.items()]
    return events


def _write_json(path: Path, payload: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload))
    tmp.replace(path)  # a viewer opening the file never sees half of it


def merge_timelines(directory: str | Path) -> Path:
    """Concatenate every ``rank{N}.json`` of ``directory`` into ``merged.json`` (pid = rank)."""
    directory = Path(directory)
    files = [p for p in directory.glob("rank*.json") if p.stem[4:].isdigit()]
    files.sort(key=lambda p: int(p.stem[4:]))
    if not files:
        raise FileNotFoundError(f"{directory} holds no rank*.json timeline; "
                                "write them with ptdp train --timeline DIR")
    events: list[dict] = []
    for file in files:
        events += json.loads(file.read_text())["traceEvents"]
    path = directory / MERGED
    _write_json(path, {"traceEvents": events, "displayTimeUnit": "ms"})
    return path


def add_timeline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["merge"], help="merge: DIR/rank*.json -> DIR/merged.json")
    parser.add_argument("directory", help="the --timeline directory of a run")


def run_timeline(args: argparse.Namespace) -> int:
    try:
        path = merge_timelines(args.directory)
    except (FileNotFoundError, json.JSONDecodeError, KeyError) as e:
        print(f"ptdp timeline: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}: open it in https://ui.perfetto.dev or chrome://tracing")
    return 0
