"""Progress for long commands: a tqdm bar on a terminal, a plain line every ``interval`` seconds otherwise.

A job log (stderr not a TTY) gets no carriage-return animation, only periodic lines a person can tail:
``preprocess: 41.2% 420.1MB/1.0GB | 812,000 documents | 2.31M tokens/s | ETA 0:01:05``.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f}{unit}" if unit != "B" else f"{int(n)}B"
        n /= 1000
    return f"{n}"


class Progress:
    """``update(done_units, documents=, tokens=)``; ``total`` in the same units (bytes of input here)."""

    def __init__(self, desc: str, total: int, unit: str = "B", interval: float = 10.0,
                 stream: TextIO | None = None, tty: bool | None = None) -> None:
        self.desc, self.total, self.interval, self.unit = desc, max(int(total), 0), interval, unit
        self.stream = stream or sys.stderr
        self.done = self.documents = self.tokens = 0
        self.start = self._last = time.perf_counter()
        tty = self.stream.isatty() if tty is None else tty
        self._bar = None
        if tty:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, unit=unit, unit_scale=unit == "B", file=self.stream, desc=desc,
                             leave=False)

    def update(self, units: int, documents: int = 0, tokens: int = 0) -> None:
        self.done += units
        self.documents += documents
        self.tokens += tokens
        now = time.perf_counter()
        if self._bar is not None:
            self._bar.update(units)
            if self.tokens:
                self._bar.set_postfix_str(f"{self.documents:,} docs, {self.rate() / 1e6:.2f}M tokens/s", refresh=False)
        elif now - self._last >= self.interval:
            self._last = now
            print(self.line(), file=self.stream, flush=True)

    def rate(self) -> float:
        return self.tokens / max(time.perf_counter() - self.start, 1e-9)

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        frac = self.done / self.total if self.total else 1.0
        eta = elapsed * (1 - frac) / frac if frac > 0 else float("nan")
        if self.unit == "B":
            done = f"{_size(self.done)}/{_size(self.total)} | {self.documents:,} documents"
        else:
            done = f"{self.done:,}/{self.total:,} {self.unit}"
        rate = f" | {self.rate() / 1e6:.2f}M tokens/s" if self.tokens else ""
        return f"{self.desc}: {100 * frac:.1f}% {done}{rate} | ETA {_eta(eta) if eta == eta else '?'}"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
