"""Store memory over time: bytes after every insert / evict / block / checkpoint event, stacked by kind.

Example:
    >>> fig = kv.viz.memory_over_time(engine.events, budget_bytes=64 << 20)
"""

from __future__ import annotations

import html

import plotly.graph_objects as go
import polars as pl

from ..errors import VizError
from ..primitives.units import fmt_bytes
from .common import COLORS, as_frame, byte_axis, empty, need

# a hybrid or sliding model's checkpoints and window KV are bytes the store holds too
STORE_EVENTS = {"insert": 1, "block_stored": 1, "evict": -1, "block_removed": -1, "checkpoint_stored": 1,
                "window_stored": 1, "checkpoint_removed": -1, "window_released": -1}
FAR = 1.5  # a budget above this many times the peak is text, not a line


def memory_over_time(events, budget_bytes: int | None = None, *, by: str = "kind",
                     max_groups: int = 12) -> go.Figure:
    """Store bytes after every insert / evict / block event: stacked by entry kind (or by entry),
    the total as a line, evictions marked, and the budget as a dashed line (as a note when it is
    more than ``FAR`` times the peak: the axis fits the data, in binary byte units).

    ``events``: ``engine.events`` (or the Engine). ``by``: "kind" or "entry".

    Example:
        >>> fig = kv.viz.memory_over_time(engine.events, budget_bytes=engine.store.budget_bytes)
        >>> fig.data[-2].y[-1] == engine.store.nbytes     # the "total" line
        True
    """
    if by not in ("kind", "entry"):
        raise VizError(f"by must be 'kind' or 'entry', got {by!r}")
    if hasattr(events, "events") and not isinstance(events, pl.DataFrame):
        events = events.events
    frame = as_frame(events, "memory_over_time's events")
    need(frame, ("event", "bytes", "t"), "memory_over_time")
    f = frame.filter(pl.col("event").is_in(list(STORE_EVENTS)))
    title = "store memory over time"
    if f.height == 0:
        fig = empty(title, "no store events yet: run a request")
        if budget_bytes:
            fig.update_layout(meta={"budget_bytes": budget_bytes})
        return fig
    get = lambda c: f[c].to_list() if c in f.columns else [None] * f.height  # noqa: E731
    ev, nb, t = f["event"].to_list(), f["bytes"].to_list(), f["t"].to_list()
    req, entry, detail = get("request"), get("entry"), get("detail")
    kind_of: dict = {}
    groups, delta = [], []
    for e, b, en, d in zip(ev, nb, entry, detail):
        sign = STORE_EVENTS[e]
        if sign > 0 and en is not None:
            kind_of[en] = d or e
        if by == "kind":
            groups.append(str(kind_of.get(en) or d or e))
        else:
            groups.append(f"entry {en}" if en is not None else e)
        delta.append(sign * int(b or 0))
    total, run = [], 0
    for d in delta:
        run += d
        total.append(run)
    # per group, the cumulative bytes at every event (so the stacked areas line up)
    names = list(dict.fromkeys(groups))
    level = {g: 0 for g in names}
    series = {g: [] for g in names}
    peak = {g: 0 for g in names}
    for g, d in zip(groups, delta):
        level[g] += d
        for name in names:
            series[name].append(level[name])
        peak[g] = max(peak[g], level[g])
    if len(names) > max_groups:
        keep = sorted(names, key=lambda g: -peak[g])[: max_groups - 1]
        other = [sum(series[g][i] for g in names if g not in keep) for i in range(len(delta))]
        series = {g: series[g] for g in names if g in keep}
        series[f"{len(names) - len(keep)} others"] = other
    custom = [[r, e, "" if en is None else en, d or ""] for r, e, en, d in zip(req, ev, entry, detail)]
    fig = go.Figure()
    for name, ys in series.items():
        fig.add_trace(go.Scatter(x=t, y=ys, name=name, mode="lines", stackgroup="groups",
                                 line=dict(shape="hv", width=0.5), customdata=custom,
                                 hovertemplate=f"{html.escape(name)}: %{{y:,}} bytes<extra></extra>"))
    fig.add_trace(go.Scatter(x=t, y=total, name="total", mode="lines+markers",
                             line=dict(shape="hv", color=COLORS["total"], width=2), marker_size=4,
                             customdata=custom,
                             hovertemplate=("total %{y:,} bytes<br>request %{customdata[0]}: "
                                            "%{customdata[1]} entry %{customdata[2]} "
                                            "(%{customdata[3]})<extra></extra>")))
    out = [i for i, e in enumerate(ev) if STORE_EVENTS[e] < 0]
    fig.add_trace(go.Scatter(x=[t[i] for i in out], y=[total[i] for i in out], name="evictions",
                             mode="markers", marker=dict(symbol="x", size=9, color=COLORS["evicted"]),
                             customdata=[custom[i] for i in out],
                             hovertemplate=("%{customdata[1]} entry %{customdata[2]} (%{customdata[3]})"
                                            "<br>request %{customdata[0]} · total after %{y:,} bytes"
                                            "<extra></extra>")))
    # the axis fits the data: a budget far above it is named in words, not drawn as a line that
    # flattens the data into the floor
    top = max(max(total), max(max(s) for s in series.values()), 1) * 1.1
    if budget_bytes and budget_bytes <= top / 1.1 * FAR:
        fig.add_hline(y=budget_bytes, line=dict(dash="dash", color=COLORS["budget"]),
                      annotation_text=f"budget {fmt_bytes(budget_bytes)}",
                      annotation_position="top left")
        top = max(top, budget_bytes * 1.05)
    elif budget_bytes:
        fig.add_annotation(xref="paper", yref="paper", x=0, y=1, xanchor="left", yanchor="top",
                           showarrow=False, font=dict(color=COLORS["budget"]),
                           text=f"budget {fmt_bytes(budget_bytes)} ({budget_bytes / (top / 1.1):,.0f}x "
                                "the peak): far above this axis")
    fig.update_layout(title=f"{title} · now {fmt_bytes(total[-1])} · peak {fmt_bytes(max(total))}"
                      f" · {len(out)} removals{_compressed(frame, series)}", xaxis_title="time since engine start (s)",
                      yaxis=dict(title="bytes held", **byte_axis(top)), height=380, margin=dict(t=40, l=60, r=10, b=40),
                      meta={"budget_bytes": budget_bytes}, legend=dict(orientation="h", y=-0.2))
    return fig


def _compressed(frame: pl.DataFrame, series: dict) -> str:
    """What a press did, from the Engine's ``compress`` rows: contexts compressed, what their
    entries hold now and what the press saved them (kvlab.compressing); "" without a press."""
    rows = frame.filter(pl.col("event") == "compress")
    if rows.height == 0:
        return ""
    held = series.get("compressed", [0])[-1]
    return (f" · {rows.height} contexts compressed ({rows['detail'][0]}): entries hold {fmt_bytes(held)}, "
            f"the press saved {fmt_bytes(int(rows['bytes'].sum()))}")
