"""Why prompt tokens were not reused: stacked bars of missed tokens by reason (the vocabulary in
``kvlab.policies.reasons``), per request or per capacity, beside the reused tokens.

Example:
    >>> kv.viz.miss_reasons(kv.simulate(trace, "lru", 2**20))            # per request
    >>> kv.viz.miss_reasons(kv.sweep(trace, "arc", caps, reasons=True))  # per capacity
    >>> kv.viz.miss_reasons(engine)                                      # per Engine request
"""

from __future__ import annotations

import html

import polars as pl

from ..errors import VizError
from ..policies.reasons import ALL_REASONS
from .extras import require

go = require("plotly.graph_objects")

REASON_COLORS = {"reused": "#2ca02c", "first_seen": "#1f77b4", "evicted": "#d62728",
                 "diverged": "#ff7f0e", "partial_block": "#c7c7c7", "salt_or_extra_keys": "#9467bd",
                 "over_capacity": "#8c564b", "not_trimmable": "#e377c2"}


def miss_reasons(result_or_frame, *, show_reused: bool = True, share: bool = False,
                 title: str | None = None) -> go.Figure:
    """Missed tokens by reason as stacked bars.

    ``result_or_frame``: a ``kv.simulate`` result or its ``requests`` frame (a bar per request),
    a ``kv.Engine`` (or a live ``kv.serve`` Server), its ``results_frame()`` or a list of its
    Results (a bar per request, labelled by request id), a ``kv.sweep(..., reasons=True)``
    frame (a bar per capacity), or ``{label: result}`` (a bar per result, e.g. per capacity or
    policy). ``show_reused`` adds the reused tokens; ``share`` draws fractions of the prompt
    tokens instead of token counts.

    Example:
        >>> fig = kv.viz.miss_reasons(kv.sweep(kv.traces.read(), "lru", [2**19, 2**23, None], reasons=True))
        >>> fig.layout.meta["totals"]["evicted"] > 0
        True
    """
    frame, x, xlabel, hover = _bars(result_or_frame)
    reasons = [r for r in ALL_REASONS if r in frame.columns]
    if not reasons:
        raise VizError(f"miss_reasons needs reason columns ({', '.join(ALL_REASONS)}); this frame has "
                       f"{frame.columns}. kv.sweep adds them with reasons=True")
    if frame.height and all(frame[r].null_count() == frame.height for r in reasons):
        raise VizError("these results carry no miss reasons (a live server's requests are not "
                       "explained); run the requests through a kv.Engine")
    parts = (["reused"] if show_reused and "hit_tokens" in frame.columns else []) + reasons
    frame = frame.with_columns(pl.col("hit_tokens").alias("reused")) if "reused" in parts else frame
    denom = (frame.select(parts).sum_horizontal() if "prompt_tokens" not in frame.columns
             else frame["prompt_tokens"]).cast(pl.Float64)
    fig = go.Figure()
    totals = {}
    for part in parts:
        values = frame[part].cast(pl.Float64)
        totals[part] = int(frame[part].sum())
        y = (values / denom.replace(0.0, None)).fill_null(0.0) if share else values
        fig.add_trace(go.Bar(x=x, y=y.to_list(), name=part, marker_color=REASON_COLORS.get(part, "#7f7f7f"),
                             customdata=hover, hovertemplate=f"{html.escape(part)}: %{{y:{'.1%' if share else ',.0f'}}}"
                                                             "<br>%{customdata}<extra></extra>"))
    fig.update_layout(barmode="stack", title=title or f"why prompt tokens were not reused, per {xlabel}",
                      xaxis=dict(title=xlabel, type="category"),
                      yaxis=dict(title="share of prompt tokens" if share else "tokens",
                                 tickformat=".0%" if share else ","),
                      height=360, margin=dict(t=40, l=60, r=10, b=40),
                      meta={"totals": totals, "bars": len(x)})
    return fig


def _bars(obj):
    """(frame, x labels, x axis title, hover text) for whatever miss_reasons was given."""
    if isinstance(obj, dict):
        rows = []
        for label, r in obj.items():
            f = _as_frame(r)
            rows.append(f.select([c for c in f.columns if c in (*ALL_REASONS, "hit_tokens", "prompt_tokens")])
                        .sum().with_columns(pl.lit(str(label)).alias("_label")))
        if not rows:
            raise VizError("miss_reasons got an empty dict; pass {label: kv.simulate(...)}")
        f = pl.concat(rows, how="diagonal")
        return f, f["_label"].to_list(), "result", f["_label"].to_list()
    f = _as_frame(obj)
    if "capacity_tokens" in f.columns and "request" not in f.columns:
        labels = ["unbounded" if c is None else f"{c:,}" for c in f["capacity_tokens"].to_list()]
        return f, labels, "capacity (tokens)", [f"capacity {c}" for c in labels]
    if "request_id" in f.columns:  # an Engine's (or a server's) requests: labelled by id
        ids = f["request_id"].to_list()
        return f, [f"#{i}" for i in ids], "request", [f"request #{i}" for i in ids]
    if "request" in f.columns:
        passes = f["pass"].to_list() if "pass" in f.columns else [None] * f.height
        hover = [f"request {r}" + (f", pass {p}" if p is not None else "")
                 for r, p in zip(f["request"].to_list(), passes)]
        return f, list(range(f.height)), "request (replay order)", hover
    return f, list(range(f.height)), "row", [f"row {i}" for i in range(f.height)]


def _as_frame(obj) -> pl.DataFrame:
    if isinstance(obj, pl.DataFrame):
        return _engine_names(obj)
    frame = getattr(obj, "requests", None)
    if isinstance(frame, pl.DataFrame):
        return frame
    results = getattr(obj, "results", obj)  # an Engine or a Server: its Results
    if isinstance(results, (list, tuple)) and all(hasattr(r, "miss_reasons") for r in results):
        rows = [r.row() for r in results]
        return _engine_names(pl.DataFrame(rows) if rows else pl.DataFrame(
            schema={"request_id": pl.Int64, "prompt_tokens": pl.Int64, "reused_tokens": pl.Int64,
                    **dict.fromkeys(ALL_REASONS, pl.Int64)}))
    raise VizError(f"miss_reasons takes a kv.simulate result, a kv.Engine, a frame with reason "
                   f"columns or {{label: result}}; got {type(obj).__name__}")


def _engine_names(f: pl.DataFrame) -> pl.DataFrame:
    """The Engine's ``reused_tokens`` is the simulator's ``hit_tokens``."""
    if "reused_tokens" in f.columns and "hit_tokens" not in f.columns:
        return f.with_columns(pl.col("reused_tokens").alias("hit_tokens"))
    return f
