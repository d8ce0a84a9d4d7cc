"""``ptdp simulate --out``: the timeline drawn like the paper's figures, one row per rank (rank 0 on top),
boxes numbered by microbatch (1-based, as in the paper) and shaded by chunk; white gaps are the bubble. An
overlapped pair (DualPipeV's F&B) is one cell with a heavy border and two shades, its forward
above its backward, as in DeepSeek's figure.

An ``.svg`` is written here, by hand, with no dependency (the README's ``ptdp simulate --out``
failed with a 12-line ``ModuleNotFoundError`` on a fresh ``pip install -e .``). ``.png`` and ``.pdf`` need a
rasteriser: matplotlib (``pip install 'ptdp[plot]'``); without it they are one line, exit 2, naming
``.svg``. Both drawers read the same marks: the boxes, and what a result adds (``extra_marks``: the
vocabulary-parallel barriers and passes).
"""

from __future__ import annotations

from pathlib import Path
from xml.sax.saxutils import escape

from ptdp.simulate.core import SimulationResult

FORWARD = ("#1f5fa8", "#6fa8dc", "#a9cbeb", "#cfe2f3")  # one shade per chunk, dark first
BACKWARD = ("#2e8540", "#7cc48a", "#b5dfbd", "#d9efdc")
WEIGHT = ("#b8860b", "#e0b84f", "#f0d68f", "#f7e8c0")
_NAMES = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}


class NeedsMatplotlib(Exception):
    """A raster or PDF picture without matplotlib installed: the message is the user's one line."""


def _colour(result: SimulationResult, op: str, chunk: int) -> str:
    palette = {"F": FORWARD, "B": BACKWARD, "I": BACKWARD, "W": WEIGHT}.get(op) or [result.colours[op]]
    return palette[chunk % len(palette)]


def _halves(box) -> list[tuple[str, int, int, float, float]]:
    """(op, microbatch, chunk, top, height) of a box's shaded parts, in fractions of its 0.8-row cell: one
    part, or an overlapped pair's forward above its backward."""
    parts = box.parts or ((box.op, box.microbatch, box.chunk),)
    height = 0.8 / len(parts)
    return [(op, mb, chunk, 0.1 + k * height, height) for k, (op, mb, chunk) in enumerate(parts)]


def _title(result: SimulationResult) -> str:
    return (f"{result.schedule}: p={result.p}, v={result.v}, m={result.m}; bubble {result.bubble_fraction:.1%} "
            f"of ideal time (formula {result.formula:.1%})")


def _legend(result: SimulationResult) -> list[tuple[str, str, str]]:
    """(kind "box", "pair" or "dashed", colour, label) of every legend entry."""
    done = {op for row in result.timelines for b in row for op, *_ in _halves(b)}
    ops = sorted(done & set("FIBW"), key="FIBW".index)
    entries = [("box", {"F": FORWARD, "W": WEIGHT}.get(op, BACKWARD)[c],
                f"{_NAMES[op]}" + (f", chunk {c}" if result.v > 1 else "")) for op in ops for c in range(result.v)]
    if any(b.parts for row in result.timelines for b in row):
        entries.append(("pair", "none", "overlapped F&B pair"))
    return entries + result.extra_marks()[1]


def draw(result: SimulationResult, out: str | Path) -> None:
    """Write the picture; the format from the suffix (.svg always; .png and .pdf with matplotlib).

    Raises NeedsMatplotlib (a one-line message) for .png / .pdf without matplotlib, OSError for the file."""
    if Path(out).suffix.lower() == ".svg":
        Path(out).write_text(svg(result))
        return
    try:
        import matplotlib
    except ImportError:
        raise NeedsMatplotlib(f"--out {out}: a {Path(out).suffix.lower()[1:].upper()} picture needs matplotlib "
                              f"(pip install 'ptdp[plot]'); --out {Path(out).with_suffix('.svg')} needs "
                              "nothing") from None
    matplotlib.use("Agg")
    _draw_matplotlib(result, out)


def svg(result: SimulationResult) -> str:
    """The picture as SVG text: 1100 px wide, 42 px per rank, the legend below."""
    p, left, width, row, top = result.p, 60.0, 1020.0, 42.0, 34.0
    scale = width / max(result.total_time, 1e-12)
    unit = min((b.end - b.start for r in result.timelines for b in r if not b.parts), default=1.0)
    legend = _legend(result)
    per_line = min(max(len(legend), 1), 6)
    height = top + p * row + 40 + 18 * -(-len(legend) // per_line)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20:.0f}" height="{height:.0f}" '
           'font-family="sans-serif" font-size="11">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{left + width / 2:.1f}" y="18" text-anchor="middle" font-size="12">{escape(_title(result))}</text>']
    small = 8 if result.m * result.v > 16 else 9
    for r, line in enumerate(result.timelines):
        y = top + r * row
        out.append(f'<text x="{left - 6:.1f}" y="{y + row / 2 + 4:.1f}" text-anchor="end">rank {r}</text>')
        for b in line:
            x, w = left + b.start * scale, (b.end - b.start) * scale
            for op, mb, chunk, at, tall in _halves(b):
                out.append(f'<rect x="{x:.2f}" y="{y + at * row:.2f}" width="{w:.2f}" height="{tall * row:.2f}" '
                           f'fill="{_colour(result, op, chunk)}" stroke="black" stroke-width="0.4"/>')
                if b.end - b.start >= 0.99 * unit:
                    colour = "white" if chunk == 0 else "black"
                    out.append(f'<text x="{x + w / 2:.2f}" y="{y + (at + tall / 2) * row + 3:.2f}" '
                               f'text-anchor="middle" font-size="{small - bool(b.parts)}" fill="{colour}">{mb + 1}</text>')
            if b.parts:  # the pair's shared border
                out.append(f'<rect x="{x:.2f}" y="{y + 0.1 * row:.2f}" width="{w:.2f}" height="{0.8 * row:.2f}" '
                           'fill="none" stroke="black" stroke-width="1.6"/>')
    lines, _ = result.extra_marks()
    for t in lines:
        x = left + t * scale
        out.append(f'<line x1="{x:.2f}" y1="{top:.1f}" x2="{x:.2f}" y2="{top + p * row:.1f}" stroke="black" '
                   'stroke-width="0.6" stroke-dasharray="4,3" opacity="0.6"/>')
    axis = top + p * row
    out.append(f'<line x1="{left}" y1="{axis:.1f}" x2="{left + width}" y2="{axis:.1f}" stroke="black"/>')
    out.append(f'<text x="{left + width / 2:.1f}" y="{axis + 16:.1f}" text-anchor="middle">time (0 to '
               f'{result.total_time:.3g})</text>')
    column = width / per_line
    for i, (kind, colour, label) in enumerate(legend):
        x, y = left + (i % per_line) * column, axis + 34 + 18 * (i // per_line)
        if kind in ("box", "pair"):
            out.append(f'<rect x="{x:.1f}" y="{y - 9:.1f}" width="12" height="10" fill="{colour}" stroke="black" '
                       f'stroke-width="{1.6 if kind == "pair" else 0.4}"/>')
        else:
            out.append(f'<line x1="{x:.1f}" y1="{y - 4:.1f}" x2="{x + 12:.1f}" y2="{y - 4:.1f}" stroke="{colour}" '
                       'stroke-dasharray="4,3"/>')
        out.append(f'<text x="{x + 16:.1f}" y="{y:.1f}">{escape(label)}</text>')
    return "\n".join([*out, "</svg>", ""])


def _draw_matplotlib(result: SimulationResult, out: str | Path) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    p, v = result.p, result.v
    fig, ax = plt.subplots(figsize=(11, 0.42 * p + 1.1), dpi=100)
    unit = min((b.end - b.start for row in result.timelines for b in row if not b.parts), default=1.0)
    for row in result.timelines:
        for b in row:
            for op, mb, chunk, at, tall in _halves(b):
                middle = b.rank - 0.5 + at + tall / 2
                ax.barh(middle, b.end - b.start, left=b.start, height=tall, color=_colour(result, op, chunk),
                        edgecolor="black", linewidth=0.4)
                if b.end - b.start >= 0.99 * unit:
                    ax.text((b.start + b.end) / 2, middle, str(mb + 1), ha="center", va="center",
                            fontsize=(6 if result.m * v > 16 else 7) - bool(b.parts),
                            color="white" if chunk == 0 else "black")
            if b.parts:  # the pair's shared border
                ax.barh(b.rank, b.end - b.start, left=b.start, height=0.8, fill=False, edgecolor="black",
                        linewidth=1.2)
    for t in result.extra_marks()[0]:
        ax.vlines(t, -0.5, p - 0.5, colors="black", linewidth=0.6, linestyles="dashed", alpha=0.6)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlim(0, result.total_time)
    ax.set_xlabel("time")
    ax.set_title(_title(result), fontsize=9)
    handles = [Patch(facecolor=colour, edgecolor="black", label=label) if kind == "box" else
               Patch(fill=False, edgecolor="black", linewidth=1.2, label=label) if kind == "pair" else
               Line2D([], [], color=colour, linestyle="dashed", linewidth=0.6, alpha=0.6, label=label)
               for kind, colour, label in _legend(result)]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35 if p < 4 else -0.22),
              ncol=min(len(handles), 5 if len(handles) > 8 else 8), fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
