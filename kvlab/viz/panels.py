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
import polars as pl

from ..diagnostics.dominant import dominant_miss, request_why
from ..primitives.tokens import common_prefix_len
from .fit import layout_size
from .misses import miss_reasons

COMPONENT_LABELS = {"full": "full KV", "window": "window KV", "recurrent": "recurrent state"}

TABLE_COLUMNS = ("#", "match", "reused / prompt", "reuse", "TTFT ms", "prefill ms", "evictions", "why")


def sync(fw: go.FigureWidget, fig: go.Figure, width: int | None = None) -> None:
    """Make ``fw`` show ``fig``: restyle traces in place when the structure is unchanged, and
    relayout with only the layout's own keys (assigning ``fw.layout`` would resend the template
    and leave the old annotations/shapes in the browser). Sized by ``kvlab.viz.fit.layout_size``:
    autosize, a height from the data, and no width unless ``width`` pins one (pixels), so the
    figure fills its column."""
    new = fig.layout.to_plotly_json()
    new.pop("template", None)
    new.pop("width", None)
    new.update(layout_size(fig, width))
    old = fw.layout.to_plotly_json()
    if new.get("autosize") and new.get("height") != old.get("height"):
        # plotly.js turns autosize off (and pins the width it has) when a relayout sets a height
        # without autosize, and plotly sends only changed keys: flip it so the relayout carries it
        fw.layout.autosize = False
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


def reference_request(engine, caps, rid: int, how: str):
    """The earlier Result that request ``rid`` is compared against, and why that one: ``how`` is
    "previous request", "entry it reused" (the request that stored the entry it hit, from the
    engine's events) or anything else for the earlier request sharing the longest prefix. (None,
    the reason) when there is none."""
    earlier = [r for r in engine.results if r.request_id < rid]
    if not earlier:
        return None, f"request #{rid} is the first: nothing was cached before it"
    if how == "previous request":
        return earlier[-1], "the previous request"
    if how == "entry it reused":
        ev = engine.events
        hit = ev.filter((pl.col("request") == rid) & (pl.col("event") == "hit"))
        entry = hit["entry"][0] if hit.height else None
        if entry is None:
            return None, f"request #{rid} reused no entry"
        if "blocks" in caps.views:
            # a paged hit names its last block's id; its events are keyed by the block's hash
            blocks = engine.store.frame("blocks").filter(pl.col("block") == int(entry))
            entry = blocks["hash"][0] if blocks.height else entry
        ins = ev.filter((pl.col("event").is_in(["insert", "block_stored"])) & (pl.col("entry") == entry))
        src = ins["request"][0] if ins.height else None
        match = next((r for r in earlier if r.request_id == src), None)
        if match is None:
            return None, f"the entry that request #{rid} reused is not from a recorded request"
        return match, f"request #{src} stored the entry it reused"
    target = next(r for r in engine.results if r.request_id == rid).prompt_ids
    best = max(reversed(earlier), key=lambda r: common_prefix_len(r.prompt_ids, target))
    return best, "the earlier request sharing the longest prefix"


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
    return (f"<div style='max-height:360px;overflow:auto;width:100%'><b>{len(rows)} requests</b>{said}"
            f"<table class='kv-requests' style='border-collapse:collapse;font-size:12px;width:100%'>"
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
