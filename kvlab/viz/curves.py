"""Hit ratio against capacity, one line per policy (kv.sweep frames in, a Figure out).

Example:
    >>> kv.viz.hit_rate_curves({p: kv.sweep(trace, p, caps) for p in ("lru", "fifo")})
"""

from __future__ import annotations

import html
import warnings

import plotly.graph_objects as go
import polars as pl

from ..errors import VizError
from .common import as_frame, need


def hit_rate_curves(sweeps, metric: str = "token_hit_rate", *, x: str = "capacity_tokens",
                     title: str | None = None) -> go.Figure:
    """Hit ratio against capacity, one line per policy (``metric="both"``: token ratio solid,
    request ratio dashed).

    ``sweeps``: ``{policy: kv.sweep(...) frame}`` or one frame with a ``policy`` column.

    Example:
        >>> caps = [2**k for k in range(10, 20)]
        >>> kv.viz.hit_rate_curves({p: kv.sweep(trace, p, caps) for p in ("lru", "fifo", "lfu")})
    """
    metrics = ("token_hit_rate", "request_hit_rate") if metric == "both" else (metric,)
    if isinstance(sweeps, dict):
        items = [(str(k), as_frame(v, f"sweeps[{k!r}]")) for k, v in sweeps.items()]
    else:
        f = as_frame(sweeps, "hit_rate_curves' sweeps")
        if "policy" not in f.columns:
            raise VizError("hit_rate_curves takes {policy: frame} or one frame with a 'policy' "
                           f"column; this frame has {f.columns}")
        items = [(str(g["policy"][0]), g) for g in f.partition_by("policy", maintain_order=True)]
    if not items:
        raise VizError("hit_rate_curves got no sweeps; pass {policy: kv.sweep(...)}")
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
               "#7f7f7f", "#bcbd22", "#17becf"]
    fig = go.Figure()
    xs_all = []
    for k, (policy, f) in enumerate(items):
        need(f, (x, *metrics), f"hit_rate_curves ({policy})")
        f = f.filter(pl.col(x).is_not_null()).sort(x)
        xs = f[x].to_list()
        xs_all += xs
        for m in metrics:
            dash = "dash" if m == "request_hit_rate" and len(metrics) > 1 else "solid"
            name = policy if len(metrics) == 1 else f"{policy} · {m.split('_')[0]}"
            fig.add_trace(go.Scatter(x=xs, y=f[m].to_list(), name=name, mode="lines+markers",
                                     line=dict(color=palette[k % len(palette)], dash=dash),
                                     hovertemplate=f"{html.escape(name)}<br>{x} %{{x:,}}<br>{m} "
                                                   "%{y:.1%}<extra></extra>"))
    positive = [v for v in xs_all if v and v > 0]
    log = bool(positive) and max(positive) / min(positive) >= 100
    fig.update_layout(title=title or f"{' and '.join(metrics)} against {x}",
                      xaxis=dict(title=x, type="log" if log else "linear"),
                      yaxis=dict(title=metrics[0] if len(metrics) == 1 else "hit rate",
                                 tickformat=".0%", range=[0, 1.02]),
                      height=360, margin=dict(t=40, l=60, r=10, b=40))
    return fig


def hit_ratio_curves(*args, **kwargs):
    """Deprecated name of :func:`hit_rate_curves` (kvlab says "hit rate" everywhere)."""
    warnings.warn("kv.viz.hit_ratio_curves is deprecated: use kv.viz.hit_rate_curves", FutureWarning,
                  stacklevel=2)
    return hit_rate_curves(*args, **kwargs)
