"""What every figure shares: colours, reading frames, showing token text, an empty figure.

Example:
    >>> as_frame([{"a": 1}], "rows").columns
    ['a']
"""

from __future__ import annotations

import html
import math
from typing import Sequence

import plotly.graph_objects as go
import polars as pl

from ..errors import VizError
from ..primitives.tokens import ROLE_COLOURS, Tokens, tokenizer_of
from ..primitives.units import fmt_bytes

COLORS = {"hit": "#2ca02c", "miss": "#c7c7c7", "evicted": "#d62728", "diverge": "#d62728",
          "volatile": "#ff7f0e", "budget": "#d62728", "total": "#222222"}
ROLES = ("template", "system", "user", "assistant", "tool", "developer", "text")
ROLE_FILL = {**ROLE_COLOURS, "template": "#f4f4f4", "text": "#e6e6e6"}


def as_frame(x, what: str) -> pl.DataFrame:
    """``x`` as a polars frame (a pandas frame or a list of dicts is converted), else VizError."""
    if isinstance(x, pl.DataFrame):
        return x
    if type(x).__module__.startswith("pandas"):
        return pl.from_pandas(x)
    if isinstance(x, list) and all(isinstance(r, dict) for r in x):
        return pl.DataFrame(x)
    raise VizError(f"{what} must be a polars DataFrame (or pandas / list of dicts), "
                   f"got {type(x).__name__}")


def need(frame: pl.DataFrame, cols: Sequence[str], what: str) -> None:
    """VizError naming the columns ``frame`` lacks."""
    missing = [c for c in cols if c not in frame.columns]
    if missing:
        raise VizError(f"{what} needs columns {list(cols)}; missing {missing} "
                       f"(it has {frame.columns})")


def tokenizer_from(x):
    """The tokenizer of a model or a Tokens, or ``x`` itself (None stays None)."""
    if x is None:
        return None
    if isinstance(x, Tokens):
        return x.tokenizer
    return tokenizer_of(x)


def visible(s: str, n: int | None = None) -> str:
    """Whitespace shown, cut to n characters, escaped for plotly's HTML-ish labels."""
    s = s.replace("\n", "↵").replace("\t", "→")
    if n is not None and len(s) > n:
        s = s[: n - 1] + "…"
    return html.escape(s, quote=False)


def discrete(colours: Sequence[str]) -> list:
    """A colorscale of equal bands, one per colour (for integer-coded heatmaps)."""
    k = len(colours)
    out = []
    for i, c in enumerate(colours):
        out += [[i / k, c], [(i + 1) / k, c]]
    return out


def empty(title: str, note: str) -> go.Figure:
    """A blank figure that says why it is blank."""
    fig = go.Figure()
    fig.update_layout(title=title, xaxis_visible=False, yaxis_visible=False, height=260,
                      annotations=[dict(text=note, showarrow=False, xref="paper", yref="paper",
                                        x=0.5, y=0.5, font_color="#888")])
    return fig


def byte_axis(top: float, count: int = 5) -> dict:
    """A y-axis from 0 to ``top`` bytes with about ``count`` round ticks labelled in binary units
    (plotly's own "1.3M" would read as 10**6).

    Example:
        >>> byte_axis(3 << 20)["ticktext"][:3]
        ['0 B', '512.0 KiB', '1.0 MiB']
    """
    top = max(float(top), 1.0)
    # the largest power of two giving at least ``count`` ticks: round in KiB, MiB and GiB alike
    step = 2 ** max(0, math.floor(math.log2(top / (count - 1))))
    ticks = [k * step for k in range(int(top // step) + 1)]
    return dict(range=[0, top], tickvals=ticks, ticktext=[fmt_bytes(v) for v in ticks])
