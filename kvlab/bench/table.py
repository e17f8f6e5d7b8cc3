"""A benchmark table (markdown for BENCHMARKS.md, HTML for notebooks) and the statistics every
section reports: median and spread over repeats."""

from __future__ import annotations

import html
import statistics
from dataclasses import dataclass, field

from ..primitives import timing
from ..primitives.display import Html, summary_html, table_html


@dataclass(frozen=True)
class Table:
    """One benchmark section's result: a titled table with the command that reproduces it, and
    the raw measured numbers (``values``) the summary against the targets is computed from.

    Example:
        >>> Table("t", "kvlab bench --only t", ("a", "b"), ((1, 2.5),)).markdown().splitlines()[0]
        '### t'
    """

    title: str
    command: str
    columns: tuple[str, ...]
    rows: tuple[tuple, ...]
    notes: str = ""
    values: dict = field(default_factory=dict, compare=False, repr=False)
    section: str = ""

    def markdown(self) -> str:
        head = "| " + " | ".join(self.columns) + " |\n|" + "---|" * len(self.columns) + "\n"
        body = "".join("| " + " | ".join(fmt(v) for v in row) + " |\n" for row in self.rows)
        notes = f"\n{self.notes}\n" if self.notes else ""
        return f"### {self.title}\n\n`{self.command}`\n\n{head}{body}{notes}"

    def __repr__(self) -> str:
        return f"Table({self.title!r}, {len(self.rows)} rows)"

    def _repr_html_(self) -> str:
        rows = [[fmt(v) for v in row] for row in self.rows]
        return summary_html(self.title, Html(f"<code>{html.escape(self.command)}</code>"),
                            note=self.notes, body=table_html(self.columns, rows, limit=None))


def fmt(v) -> str:
    """A table cell: floats to 3 significant digits (thousands separated above 1000)."""
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def spread(xs) -> dict:
    """Median, population stdev, min and max of repeated measurements.

    Example:
        >>> spread([1.0, 2.0, 4.0])["median"]
        2.0
    """
    xs = list(xs)
    return {"median": statistics.median(xs), "pstdev": statistics.pstdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs), "max": max(xs), "n": len(xs)}


def timed(fn, repeats: int):
    """``fn()`` run ``repeats`` times (at least once): its last result and the seconds of each run
    (MLX arrays in the result are evaluated inside the run: ``kvlab.primitives.timing``).

    Example:
        >>> out, seconds = timed(lambda: 6 * 7, 3)
        >>> out, len(seconds)
        (42, 3)
    """
    out, seconds = None, []
    for _ in range(max(1, repeats)):
        t0 = timing.timed()
        out = fn()
        seconds.append(t0.done(out))
    return out, seconds


def ms(s: dict) -> str:
    """A spread of seconds as "median ± pstdev (min-max)" in milliseconds."""
    return f"{s['median'] * 1e3:.1f} ± {s['pstdev'] * 1e3:.1f} ({s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f})"


def median_range(v: dict, scale: float = 1.0) -> str:
    """A spread as "median (min-max)"."""
    return f"{v['median'] * scale:.4g} ({v['min'] * scale:.4g}-{v['max'] * scale:.4g})"
