"""The Inspector's panels: keeping a FigureWidget in step with a Figure, the requests table and
the misses by reason.

Example:
    >>> fw = go.FigureWidget(); sync(fw, kv.viz.prefix_tree(engine.store))
    >>> table_html(table_rows(engine.results))
    >>> misses_figure(engine.results).layout.meta["totals"]
"""

from __future__ import annotations

import html

import plotly.graph_objects as go

from ..diagnostics.dominant import dominant_miss, request_why
from .misses import miss_reasons

COMPONENT_LABELS = {"full": "full KV", "window": "window KV", "recurrent": "recurrent state"}

TABLE_COLUMNS = ("#", "match", "reused / prompt", "reuse", "TTFT ms", "prefill ms", "evictions", "why")


def sync(fw: go.FigureWidget, fig: go.Figure, width: int | None = None) -> None:
    """Make ``fw`` show ``fig``: restyle traces in place when the structure is unchanged, and
    relayout with only the layout's own keys (assigning ``fw.layout`` would resend the template
    and leave the old annotations/shapes in the browser)."""
    new = fig.layout.to_plotly_json()
    new.pop("template", None)
    if width:
        new["width"] = width
    old = fw.layout.to_plotly_json()
    with fw.batch_update():
        same = len(fw.data) == len(fig.data) and all(a.type == b.type for a, b in zip(fw.data, fig.data))
        if same:
            for a, b in zip(fw.data, fig.data):
                props = b.to_plotly_json()
                props.pop("type", None)
                a.update(props, overwrite=True)
        else:
            fw.data = ()
            fw.add_traces(list(fig.data))
        for key in old.keys() - new.keys() - {"template"}:
            fw.layout[key] = None
        fw.layout.update(new, overwrite=True)


def table_rows(results) -> list[list]:
    """One row per engine Result, in TABLE_COLUMNS order; "why" is the request's main miss reason
    and, for a divergence, its token (``kvlab.diagnostics.request_why``), then the engine's note."""
    return [[r.request_id, r.match, f"{r.reused_tokens} / {r.prompt_tokens}", f"{r.reuse_ratio:.0%}",
             round(r.ttft_s * 1e3, 1), round(r.prefill_s * 1e3, 1), r.evictions, request_why(r)]
            for r in results]


def run_cause(results, tokenizer) -> str | None:
    """The run's dominant miss in one sentence (where, what differs, the fix), or None when no
    single place holds most missed tokens (``kvlab.diagnostics.dominant_miss``)."""
    found = dominant_miss(results, tokenizer=tokenizer)
    return None if found is None else found.sentence("api")


def table_html(rows: list[list], cause: str | None = None) -> str:
    """The requests as an HTML table (a plotly Table drawn in a hidden tab loses its text), under
    the run's dominant miss when it has one."""
    cell = "padding:2px 8px;border-bottom:1px solid #e5e5e5;text-align:left"
    head = "".join(f"<th style='{cell};background:#f2f2f2'>{html.escape(c)}</th>" for c in TABLE_COLUMNS)
    body = "".join("<tr>" + "".join(f"<td style='{cell}'>{html.escape(str(v))}</td>" for v in row)
                   + "</tr>" for row in rows)
    said = "" if cause is None else f"<p class='kv-cause' style='margin:4px 0'>Why: {html.escape(cause)}</p>"
    return (f"<div style='max-height:360px;overflow:auto'><b>{len(rows)} requests</b>{said}"
            f"<table class='kv-requests' style='border-collapse:collapse;font-size:12px'>"
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>")


def misses_figure(results) -> go.Figure:
    """Missed tokens by reason per request (``kv.viz.miss_reasons``), or a note when the results
    carry no reasons (a server running mlx-lm's own LRUPromptCache does not explain its misses)."""
    results = list(results)
    if results and not any(r.miss_reasons for r in results):
        return go.Figure(layout=dict(height=200, meta={"totals": None, "bars": 0},
                                     title="why tokens missed: not recorded by this server's cache "
                                           "(serve a kvlab store, or run the requests through a kv.Engine)"))
    return miss_reasons(results, title="why prompt tokens were not reused, per request")


def components_of(store, caps) -> dict | None:
    """Bytes per component (``full``, ``window``, ``recurrent``) and the checkpoint count of a
    store whose capabilities say it reports them, else None."""
    if store is None or not caps.components:
        return None
    c = store.components()
    return {**{k: int(c[k]) for k in COMPONENT_LABELS}, "checkpoints": int(c["checkpoints"])}


def components_text(c: dict | None) -> tuple[str, ...]:
    """The header's words for ``components_of``'s figures (exact bytes: they are what is measured)."""
    if c is None:
        return ()
    return tuple(f"{label} {c[k]:,} B" for k, label in COMPONENT_LABELS.items()) + (f"{c['checkpoints']} checkpoints",)
