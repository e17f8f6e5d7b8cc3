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


OPTIMA = ("belady", "optimum")  # the offline optimum: the ceiling every online policy is drawn under
OPTIMUM_STYLE = dict(color="black", dash="dash", width=3)
MUTED = "#c7c7c7"
AXIS_TITLES = {"capacity_tokens": "cache capacity, tokens", "capacity_blocks": "cache capacity, blocks",
               "token_hit_rate": "token hit rate (share of prompt tokens reused)",
               "request_hit_rate": "request hit rate (share of requests with a hit)"}


def hit_rate_curves(sweeps, metric: str = "token_hit_rate", *, x: str = "capacity_tokens",
                    title: str | None = None, highlight: int = 4) -> go.Figure:
    """Hit ratio against capacity, one line per policy (``metric="both"``: token ratio solid,
    request ratio dashed).

    ``sweeps``: ``{policy: kv.sweep(...) frame}`` or one frame with a ``policy`` column. The
    optimum (``belady``) is drawn black and dashed and named as the ceiling; with more than
    ``highlight`` other policies only the best ``highlight`` (by mean hit rate) get colours, the
    rest are grey. The y axis fits the data.

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
               "#17becf", "#bcbd22", "#7f7f7f"]
    for policy, f in items:
        need(f, (x, *metrics), f"hit_rate_curves ({policy})")
    online = [(p, f) for p, f in items if p not in OPTIMA]
    mean = {p: f[metrics[0]].drop_nulls().mean() or 0.0 for p, f in online}
    coloured = (set(sorted(mean, key=lambda p: -mean[p])[:highlight]) if len(online) > highlight
                else set(mean))
    fig = go.Figure()
    xs_all, ys_all, k = [], [], 0
    for policy, f in items:
        f = f.filter(pl.col(x).is_not_null()).sort(x)
        xs = f[x].to_list()
        xs_all += xs
        optimum = policy in OPTIMA
        for m in metrics:
            ys = f[m].to_list()
            ys_all += [v for v in ys if v is not None]
            label = f"{policy} (optimum: the ceiling)" if optimum else policy
            name = label if len(metrics) == 1 else f"{label} · {m.split('_')[0]}"
            dash = "dash" if m == "request_hit_rate" and len(metrics) > 1 else "solid"
            if optimum:
                line = dict(OPTIMUM_STYLE, dash="dot" if dash == "dash" else "dash")
            elif policy in coloured:
                line = dict(color=palette[k % len(palette)], dash=dash, width=2)
            else:
                line = dict(color=MUTED, dash=dash, width=1)
            fig.add_trace(go.Scatter(x=xs, y=ys, name=name, mode="lines+markers",
                                     line=line, marker=dict(size=7 if optimum else 5),
                                     hovertemplate=f"{html.escape(name)}<br>{x.replace('_', ' ')} %{{x:,}}"
                                                   f"<br>{m.replace('_', ' ')} %{{y:.1%}}<extra></extra>"))
        if not optimum and policy in coloured:
            k += 1
    # the optimum on top of the policies it bounds
    fig.data = [t for t in fig.data if "optimum" not in t.name] + [t for t in fig.data if "optimum" in t.name]
    positive = [v for v in xs_all if v and v > 0]
    log = bool(positive) and max(positive) / min(positive) >= 100
    top = max(ys_all, default=1.0)
    y_top = min(1.02, max(0.05, top * 1.08 + 0.01))  # fit the data: a 24% ceiling is not drawn under 100%
    x_title = AXIS_TITLES.get(x, x.replace("_", " ")) + (" (log scale)" if log else "")
    y_title = AXIS_TITLES.get(metrics[0], metrics[0].replace("_", " ")) if len(metrics) == 1 else "hit rate"
    fig.update_layout(title=title or f"{' and '.join(metrics)} against {x}",
                      xaxis=dict(title=x_title, type="log" if log else "linear"),
                      yaxis=dict(title=y_title, tickformat=".0%", range=[0, y_top]),
                      height=400, margin=dict(t=40, l=60, r=10, b=40),
                      meta={"optimum": [t.name for t in fig.data if "optimum" in t.name],
                            "highlighted": sorted(coloured)})
    return fig


def hit_ratio_curves(*args, **kwargs):
    """Deprecated name of :func:`hit_rate_curves` (kvlab says "hit rate" everywhere)."""
    warnings.warn("kv.viz.hit_ratio_curves is deprecated: use kv.viz.hit_rate_curves", FutureWarning,
                  stacklevel=2)
    return hit_rate_curves(*args, **kwargs)
