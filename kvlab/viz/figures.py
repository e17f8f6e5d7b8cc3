"""Figures: frames and objects in, a plotly Figure out. Nothing here touches an Engine's internals.

Example:
    >>> kv.viz.prefix_tree(engine.store, m.tokenizer, color="recency")
    >>> kv.viz.memory_over_time(engine.events, budget_bytes=64 << 20)
    >>> kv.viz.divergence(toks_a, toks_b)
    >>> kv.viz.block_grid(engine, block_size=16)
    >>> kv.viz.hit_ratio_curves({"lru": kv.sweep(trace, "lru", caps), "fifo": kv.sweep(trace, "fifo", caps)})
"""

from __future__ import annotations

import html
import math
from typing import Sequence

import plotly.graph_objects as go
import polars as pl

from ..tokens import KNOWN_ROLES, ROLE_COLOURS, Span, Tokens
from . import VizError

COLORS = {"hit": "#2ca02c", "miss": "#c7c7c7", "evicted": "#d62728", "diverge": "#d62728",
          "volatile": "#ff7f0e", "budget": "#d62728", "total": "#222222"}
ROLES = ("template", "system", "user", "assistant", "tool", "developer", "text")
_ROLE_FILL = {**ROLE_COLOURS, "template": "#f4f4f4", "text": "#e6e6e6"}
_STORE_EVENTS = {"insert": 1, "block_stored": 1, "evict": -1, "block_removed": -1}


# ------------------------------------------------------------------------------------ helpers

def _frame(x, what: str) -> pl.DataFrame:
    if isinstance(x, pl.DataFrame):
        return x
    if type(x).__module__.startswith("pandas"):
        return pl.from_pandas(x)
    if isinstance(x, list) and all(isinstance(r, dict) for r in x):
        return pl.DataFrame(x)
    raise VizError(f"{what} must be a polars DataFrame (or pandas / list of dicts), "
                   f"got {type(x).__name__}")


def _need(frame: pl.DataFrame, cols: Sequence[str], what: str) -> None:
    missing = [c for c in cols if c not in frame.columns]
    if missing:
        raise VizError(f"{what} needs columns {list(cols)}; missing {missing} "
                       f"(it has {frame.columns})")


def _tokenizer(t):
    """A tokenizer from a model, a Tokens or a tokenizer (None stays None)."""
    if t is None:
        return None
    if isinstance(t, Tokens):
        return t.tokenizer
    return getattr(t, "tokenizer", t)


def _hf(tok):
    return getattr(tok, "_tokenizer", tok)


def pieces(tokenizer, ids: Sequence[int]) -> list[str]:
    """Each id decoded on its own (one batched call over the distinct ids)."""
    ids = [int(i) for i in ids]
    if tokenizer is None:
        return [f"<{i}>" for i in ids]
    hf = _hf(tokenizer)
    uniq = list(dict.fromkeys(ids))
    if hasattr(hf, "batch_decode"):
        table = dict(zip(uniq, hf.batch_decode([[i] for i in uniq])))
    else:
        table = {i: hf.decode([i]) for i in uniq}
    return [table[i] for i in ids]


def _visible(s: str, n: int | None = None) -> str:
    """Whitespace shown, cut to n characters, escaped for plotly's HTML-ish labels."""
    s = s.replace("\n", "↵").replace("\t", "→")
    if n is not None and len(s) > n:
        s = s[: n - 1] + "…"
    return html.escape(s, quote=False)


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} GiB"


def _discrete(colours: Sequence[str]) -> list:
    """A colorscale of equal bands, one per colour (for integer-coded heatmaps)."""
    k = len(colours)
    out = []
    for i, c in enumerate(colours):
        out += [[i / k, c], [(i + 1) / k, c]]
    return out


def _empty(title: str, note: str) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=title, xaxis_visible=False, yaxis_visible=False, height=260,
                      annotations=[dict(text=note, showarrow=False, xref="paper", yref="paper",
                                        x=0.5, y=0.5, font_color="#888")])
    return fig


# -------------------------------------------------------------------------------- prefix tree

def _tree_frame(x) -> pl.DataFrame:
    for method in ("tree_frame", "blocks_frame"):
        if hasattr(x, method):
            return getattr(x, method)()
    if hasattr(x, "store") and x.store is not None:
        return _tree_frame(x.store)
    try:
        return _frame(x, "prefix_tree's input")
    except VizError:
        raise VizError(f"prefix_tree takes a store with tree_frame() (RadixStore, PagedStore), an "
                       f"Engine, or the tree frame itself; got {type(x).__name__}") from None


def _normalise_tree(frame: pl.DataFrame) -> pl.DataFrame:
    """PagedStore.blocks_frame() (block, hash, parent hash, token_ids) as tree rows."""
    if "id" in frame.columns or "hash" not in frame.columns:
        return frame
    cols = [pl.col("hash").alias("id")]
    if "token_ids" in frame.columns and "tokens" not in frame.columns:
        cols.append(pl.col("token_ids").list.len().alias("tokens"))
    if "block" in frame.columns and "entry" not in frame.columns:
        cols.append(pl.col("block").alias("entry"))
    return frame.with_columns(cols)


def _positions(ids: list[str], parents: list[str], tokens: list[int]):
    """[start, end) token positions of each node from its ancestors' sizes (block chains)."""
    index = {n: i for i, n in enumerate(ids)}
    start: list[int | None] = [None] * len(ids)

    def walk(i: int) -> int:
        chain = []
        while start[i] is None:
            chain.append(i)
            p = index.get(parents[i])
            if p is None or p in chain:
                start[i] = 0
                chain.pop()
                break
            i = p
        for j in reversed(chain):
            p = index[parents[j]]
            start[j] = start[p] + tokens[p]

    for i in range(len(ids)):
        walk(i)
    return start, [s + t for s, t in zip(start, tokens)]


def prefix_tree(store_or_frame, tokenizer=None, color: str = "hits", *, label_chars: int = 24,
                hover_chars: int = 160) -> go.Figure:
    """The store's prefix tree as an icicle: one box per node, size = its tokens (plus the
    subtree's), colour = hits or recency, hover = the node's decoded text, bytes and last use.

    ``store_or_frame``: a store with ``tree_frame()``, an Engine, or a frame with columns
    ``id, parent, tokens`` (optional ``edge_ids, hits, last_used, bytes, entry, start, depth``).

    Example:
        >>> fig = kv.viz.prefix_tree(engine.store, m.tokenizer)
        >>> sum(fig.data[0].values) == engine.store.tree_frame()["tokens"].sum()
        True
    """
    if color not in ("hits", "recency"):
        raise VizError(f"color must be 'hits' or 'recency', got {color!r}")
    frame = _normalise_tree(_tree_frame(store_or_frame))
    _need(frame, ("id", "parent", "tokens"), "prefix_tree")
    tok = _tokenizer(tokenizer)
    n = frame.height
    if n == 0:
        return _empty("prefix tree", "the store is empty: run a request")

    def col(name, default):
        return frame[name].to_list() if name in frame.columns else [default] * n

    node_ids = [str(i) for i in frame["id"].to_list()]
    known = set(node_ids)
    parents = ["" if p is None else str(p) for p in frame["parent"].to_list()]
    tokens = [int(t) for t in frame["tokens"].to_list()]
    edge_col = next((c for c in ("edge_ids", "token_ids", "ids") if c in frame.columns), None)
    edges = frame[edge_col].to_list() if edge_col else [None] * n
    hits, last = col("hits", 0), col("last_used", 0)
    nbytes, entry = col("bytes", 0), col("entry", None)
    start, depth = col("start", None), col("depth", None)
    if "start" not in frame.columns:
        start, depth = _positions(node_ids, parents, tokens)
    # plotly draws one root; several parentless nodes (block chains) or orphans hang off a stand-in
    roots = [i for i, p in enumerate(parents) if p == "" or p not in known]
    synthetic = len(roots) != 1 or parents[roots[0]] != ""
    if synthetic:
        for i in roots:
            parents[i] = "root"
    texts = []
    for e in edges:
        if e is None or tok is None:
            texts.append(None)
        else:
            texts.append(_hf(tok).decode([int(t) for t in e]))
    labels = []
    for i in range(n):
        if tokens[i] == 0 and parents[i] in ("", "root") and not synthetic:
            labels.append("root")
        elif texts[i] is not None:
            labels.append(_visible(texts[i], label_chars) or "∅")
        else:
            labels.append(f"#{node_ids[i]} · {tokens[i]} tok")
    hover = [_visible(t, hover_chars) if t is not None else "" for t in texts]
    custom = [[hover[i], int(nbytes[i] or 0), last[i], hits[i], tokens[i],
               "" if start[i] is None else start[i], "" if depth[i] is None else depth[i],
               "—" if entry[i] is None else entry[i]] for i in range(n)]
    values = list(tokens)
    shade = hits if color == "hits" else last
    if synthetic:
        node_ids.append("root"), parents.append(""), labels.append("root"), values.append(0)
        custom.append(["", 0, 0, 0, 0, "", "", "—"]), shade.append(0)
    fig = go.Figure(go.Icicle(
        ids=node_ids, parents=parents, labels=labels, values=values, branchvalues="remainder",
        customdata=custom, marker=dict(colors=shade, colorscale="Blues" if color == "hits" else "Viridis",
                                       showscale=True, colorbar=dict(title=color, thickness=12)),
        hovertemplate=("<b>%{label}</b><br>%{customdata[4]} tokens [%{customdata[5]}, %{customdata[6]})"
                       "<br>%{customdata[1]:,} bytes · entry %{customdata[7]}"
                       "<br>hits %{customdata[3]} · last use %{customdata[2]}"
                       "<br><span style='font-family:monospace'>%{customdata[0]}</span><extra></extra>"),
        tiling=dict(orientation="v"), root=dict(color="#eeeeee"), sort=False))
    fig.update_layout(title=f"prefix tree · {n} nodes · {sum(tokens)} tokens · colour = {color}",
                      margin=dict(t=40, l=10, r=10, b=10), height=420)
    return fig


# ---------------------------------------------------------------------------- memory over time

def memory_over_time(events, budget_bytes: int | None = None, *, by: str = "kind",
                     max_groups: int = 12) -> go.Figure:
    """Store bytes after every insert / evict / block event: stacked by entry kind (or by entry),
    the total as a line, evictions marked, and the budget as a dashed line.

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
    frame = _frame(events, "memory_over_time's events")
    _need(frame, ("event", "bytes", "t"), "memory_over_time")
    f = frame.filter(pl.col("event").is_in(list(_STORE_EVENTS)))
    title = "store memory over time"
    if f.height == 0:
        fig = _empty(title, "no store events yet: run a request")
        if budget_bytes:
            fig.update_layout(meta={"budget_bytes": budget_bytes})
        return fig
    get = lambda c: f[c].to_list() if c in f.columns else [None] * f.height  # noqa: E731
    ev, nb, t = f["event"].to_list(), f["bytes"].to_list(), f["t"].to_list()
    req, entry, detail = get("request"), get("entry"), get("detail")
    kind_of: dict = {}
    groups, delta = [], []
    for e, b, en, d in zip(ev, nb, entry, detail):
        sign = _STORE_EVENTS[e]
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
    out = [i for i, e in enumerate(ev) if _STORE_EVENTS[e] < 0]
    fig.add_trace(go.Scatter(x=[t[i] for i in out], y=[total[i] for i in out], name="evictions",
                             mode="markers", marker=dict(symbol="x", size=9, color=COLORS["evicted"]),
                             customdata=[custom[i] for i in out],
                             hovertemplate=("%{customdata[1]} entry %{customdata[2]} (%{customdata[3]})"
                                            "<br>request %{customdata[0]} · total after %{y:,} bytes"
                                            "<extra></extra>")))
    if budget_bytes:
        fig.add_hline(y=budget_bytes, line=dict(dash="dash", color=COLORS["budget"]),
                      annotation_text=f"budget {fmt_bytes(budget_bytes)}",
                      annotation_position="top left")
    fig.update_layout(title=f"{title} · now {fmt_bytes(total[-1])} · peak {fmt_bytes(max(total))}"
                      f" · {len(out)} removals", xaxis_title="time since engine start (s)",
                      yaxis_title="bytes", height=380, margin=dict(t=40, l=60, r=10, b=40),
                      meta={"budget_bytes": budget_bytes}, legend=dict(orientation="h", y=-0.2))
    return fig


# ----------------------------------------------------------------------------------- divergence

def _im_start(tokenizer) -> int | None:
    hf = _hf(tokenizer)
    try:
        i = hf.convert_tokens_to_ids("<|im_start|>")
    except Exception:  # tokenizers without the method or the token
        return None
    return i if isinstance(i, int) and i != getattr(hf, "unk_token_id", None) else None


def tokens_from_ids(ids: Sequence[int], tokenizer=None) -> Tokens:
    """Tokens for raw ids with per-token offsets and, for ChatML templates (<|im_start|>role),
    message spans, so a divergence can be placed in a message without the original messages."""
    ids = tuple(int(i) for i in ids)
    tok = _tokenizer(tokenizer)
    if tok is None:
        return Tokens(ids, "", (), (), None, (), None)
    ps = pieces(tok, ids)
    offsets, c = [], 0
    for p in ps:
        offsets.append((c, c + len(p)))
        c += len(p)
    text = "".join(ps)
    starts = []
    marker = _im_start(tok)
    if marker is not None:
        starts = [i for i, t in enumerate(ids) if t == marker]
    spans = []
    for k, s in enumerate(starts):
        e = starts[k + 1] if k + 1 < len(starts) else len(ids)
        head = text[offsets[s][1]: offsets[e - 1][1] if e > s else offsets[s][1]]
        role = head.split("\n", 1)[0].strip()
        if role in KNOWN_ROLES:
            spans.append(Span(len(spans), role, s, e, offsets[s][0], offsets[e - 1][1]))
    return Tokens(ids, text, tuple(spans), tuple(offsets), None, (), tok)


def _as_tokens(x, tokenizer, name: str) -> Tokens:
    if isinstance(x, Tokens):
        return x
    if hasattr(x, "prompt_ids"):  # an engine Result
        return tokens_from_ids(x.prompt_ids, tokenizer)
    if isinstance(x, str) or (isinstance(x, (list, tuple)) and x and isinstance(x[0], dict)):
        if tokenizer is None or not hasattr(tokenizer, "tokenizer"):
            raise VizError(f"{name} is text or messages; pass the model as the third argument "
                           f"(divergence(a, b, model)) or tokenise first with kv.tokenise")
        from ..tokens import tokenise

        return tokenise(tokenizer, x)
    try:
        ids = [int(i) for i in x]
    except (TypeError, ValueError):
        raise VizError(f"{name} must be Tokens, a Result or token ids, got {type(x).__name__}") from None
    return tokens_from_ids(ids, tokenizer)


def _volatile(ta: Tokens, tb: Tokens) -> list[tuple[int, int, str]]:
    """(token_start, token_end, name) of the volatile fields, in ``ta``'s coordinates."""
    if not (ta.text and tb.text and ta.offsets):
        return []
    from ..volatile import volatile_fields
    from ..errors import KvlabError

    try:
        fields = volatile_fields([ta, tb])
    except KvlabError:
        return []
    return [(f.token_start, f.token_end, f.name or "?") for f in fields
            if f.token_start is not None and f.token_end is not None and f.token_end > f.token_start]


def divergence(a, b, tokenizer=None, *, volatile=True, window: int = 400,
               max_tokens: int = 20_000) -> go.Figure:
    """Two prompts as token strips (rows a and b), coloured by message role, with message
    boundaries, the first differing token boxed in red, the part no prefix cache can reuse shaded,
    and volatile fields (ids, hashes, the billing header's cch=) boxed in orange. Hover shows
    each token's decoded text.

    ``a``, ``b``: Tokens, engine Results or token ids; ``tokenizer``: a tokenizer or model (for ids;
    Tokens carry their own). ``volatile``: True (find them with kv.volatile_fields), False, or a list
    of ``(token_start, token_end, name)`` in a's coordinates. The x range opens ``window`` tokens
    around the difference; prompts longer than ``max_tokens`` are cut around it.

    Example:
        >>> fig = kv.viz.divergence(kv.tokenise(m, req_a), kv.tokenise(m, req_b))
        >>> fig.layout.meta["token_index"]
        35
    """
    from ..divergence import diverge

    if tokenizer is None:
        carrier = a if isinstance(a, Tokens) else b if isinstance(b, Tokens) else None
        tokenizer = _tokenizer(carrier)
    ta, tb = _as_tokens(a, tokenizer, "a"), _as_tokens(b, tokenizer, "b")
    d = diverge(ta, tb)
    idx, common = d.token_index, d.common
    length = max(len(ta), len(tb))
    lo, hi = 0, length
    if length > max_tokens:
        centre = common
        lo = max(0, min(centre - max_tokens // 2, length - max_tokens))
        hi = lo + max_tokens
    xs = list(range(lo, hi))
    code = {r: k for k, r in enumerate(ROLES)}
    z, text = [], []
    for t in (ta, tb):
        ps = [t.piece(i) for i in range(lo, min(hi, len(t)))]
        row_z, row_t = [], []
        for i in xs:
            if i >= len(t):
                row_z.append(None), row_t.append("")
                continue
            span = t.span_at(i)
            role = span.role if span else "template"
            row_z.append(code.get(role, 0))
            row_t.append(f"#{i} id {t.ids[i]} · {role}<br>{_visible(repr(ps[i - lo])[1:-1], 80)}")
        z.append(row_z), text.append(row_t)
    fig = go.Figure(go.Heatmap(
        x=xs, y=[0, 1], z=z, text=text, hovertemplate="%{text}<extra></extra>", zmin=-0.5,
        zmax=len(ROLES) - 0.5, colorscale=_discrete([_ROLE_FILL[r] for r in ROLES]),
        xgap=1 if len(xs) <= 400 else 0, ygap=4, name="tokens",
        colorbar=dict(tickvals=list(range(len(ROLES))), ticktext=list(ROLES), thickness=10, len=1.0)))
    shapes = []
    row_y = {0: (-0.5, 0.5), 1: (0.5, 1.5)}
    for r, t in enumerate((ta, tb)):
        y0, y1 = row_y[r]
        for s in t.spans:
            if lo < s.token_start < hi and s.role != "text":
                shapes.append(dict(type="line", x0=s.token_start - 0.5, x1=s.token_start - 0.5,
                                   y0=y0, y1=y1, line=dict(color="#555", width=2)))
    if common < length:
        shapes.append(dict(type="rect", x0=max(common, lo) - 0.5, x1=hi - 0.5, y0=-0.5, y1=1.5,
                           fillcolor="rgba(0,0,0,0.10)", line_width=0, layer="above"))
    fields = []
    if volatile is True:
        fields = [(s, e, n, 0) for s, e, n in _volatile(ta, tb)] + \
                 [(s, e, n, 1) for s, e, n in _volatile(tb, ta)]
    elif volatile:
        fields = [(int(s), int(e), str(n), 0) for s, e, n in volatile]
    for s, e, name, r in fields:
        y0, y1 = row_y[r]
        shapes.append(dict(type="rect", x0=s - 0.5, x1=e - 0.5, y0=y0, y1=y1, layer="above",
                           line=dict(color=COLORS["volatile"], width=2), fillcolor="rgba(0,0,0,0)"))
    if fields:
        fig.add_trace(go.Scatter(
            x=[(s + e - 1) / 2 for s, e, _, _ in fields], y=[r for *_, r in fields], mode="markers",
            marker=dict(symbol="square-open", color=COLORS["volatile"], size=10),
            name="volatile fields", text=[f"volatile field {html.escape(n)}: tokens {s}:{e}"
                                          for s, e, n, _ in fields],
            hovertemplate="%{text}<extra></extra>"))
    if idx is not None:
        shapes.append(dict(type="rect", x0=idx - 0.5, x1=idx + 0.5, y0=-0.5, y1=1.5, layer="above",
                           line=dict(color=COLORS["diverge"], width=3), fillcolor="rgba(0,0,0,0)"))
        fig.add_trace(go.Scatter(
            x=[idx, idx], y=[0, 1], mode="markers", name="first difference",
            marker=dict(symbol="diamond", color=COLORS["diverge"], size=9),
            text=[_visible(repr(d.token_a), 60), _visible(repr(d.token_b), 60)],
            hovertemplate=f"first difference, token {idx}: %{{text}}<extra></extra>"))
        where = f" in message {d.message_index} ({d.role})" if d.message_index is not None else ""
        title = (f"first difference at token {idx}{where}: {_visible(repr(d.token_a), 30)} vs "
                 f"{_visible(repr(d.token_b), 30)} · {common} tokens reusable")
    elif d.identical:
        title = f"identical: {len(ta)} tokens"
    else:
        title = f"{'a' if len(ta) < len(tb) else 'b'} is a prefix of the other: {common} tokens shared"
    if idx is not None and length > window:
        x_range = [max(lo, idx - window // 2) - 0.5, min(hi, max(lo, idx - window // 2) + window) - 0.5]
    else:
        x_range = [lo - 0.5, hi - 0.5]
    fig.update_layout(
        title=dict(text=title, font_size=13), shapes=shapes, height=260,
        margin=dict(t=40, l=40, r=10, b=40), showlegend=False,
        xaxis=dict(title="token index", range=x_range),
        yaxis=dict(tickvals=[0, 1], ticktext=["a", "b"], autorange="reversed", range=[1.5, -0.5]),
        meta={"token_index": idx, "common": common, "len_a": len(ta), "len_b": len(tb),
              "volatile": [[s, e, n, r] for s, e, n, r in fields]})
    return fig


# ----------------------------------------------------------------------------------- block grid

def _requests(x) -> list[dict]:
    if hasattr(x, "results") and not isinstance(x, pl.DataFrame):
        x = x.results
    if isinstance(x, (list, tuple)) and all(hasattr(r, "prompt_ids") for r in x):
        return [{"request": r.request_id, "prompt": r.prompt_tokens, "reused": r.reused_tokens,
                 "ids": tuple(r.prompt_ids) or None} for r in x]
    f = _frame(x, "block_grid's input")
    rid = next((c for c in ("request_id", "request") if c in f.columns), None)
    reused = next((c for c in ("reused_tokens", "hit_tokens") if c in f.columns), None)
    ids = next((c for c in ("prompt_ids", "ids") if c in f.columns), None)
    if rid is None or reused is None or "prompt_tokens" not in f.columns:
        raise VizError("block_grid needs an Engine, a list of Results or a frame with request_id, "
                       f"prompt_tokens and reused_tokens (optional prompt_ids); got {f.columns}")
    id_lists = f[ids].to_list() if ids else [None] * f.height
    return [{"request": r, "prompt": p, "reused": u, "ids": None if i is None else tuple(i)}
            for r, p, u, i in zip(f[rid].to_list(), f["prompt_tokens"].to_list(),
                                  f[reused].to_list(), id_lists)]


def block_states(requests: list[dict], block_size: int) -> list[list[int | None]]:
    """0 hit, 1 miss, 2 evicted (a full block computed although an earlier request had computed the
    same prefix block), None past the prompt. A block is a hit when all of its tokens before the
    prompt's last one are reused (the last token is always computed)."""
    seen: set = set()
    grid = []
    width = max((math.ceil(r["prompt"] / block_size) for r in requests), default=0)
    for r in requests:
        n, reused, ids = r["prompt"], r["reused"], r["ids"]
        row: list[int | None] = []
        for b in range(width):
            start, end = b * block_size, min(n, (b + 1) * block_size)
            if start >= n:
                row.append(None)
                continue
            usable = min(end, n - 1)
            if usable > start and usable <= reused:
                row.append(0)
            elif ids is not None and end - start == block_size and hash(ids[:end]) in seen:
                row.append(2)
            else:
                row.append(1)
        if ids is not None:  # only full blocks are cacheable (as in vLLM)
            seen.update(hash(ids[: (b + 1) * block_size]) for b in range(n // block_size))
        grid.append(row)
    return grid


def block_grid(engine_or_frames, block_size: int = 16) -> go.Figure:
    """Requests x blocks: which blocks each request reused (hit), computed fresh (miss), or had to
    recompute although an earlier request had computed the same prefix block (evicted).

    ``engine_or_frames``: an Engine, its ``results``, or a frame with ``request_id, prompt_tokens,
    reused_tokens`` (and ``prompt_ids`` to tell evicted blocks from new ones).

    Example:
        >>> kv.viz.block_grid(engine, block_size=16).layout.meta["counts"]
        {'hit': 39, 'miss': 12, 'evicted': 0}
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise VizError(f"block_size must be a positive int, got {block_size!r}")
    reqs = _requests(engine_or_frames)
    if not reqs:
        return _empty("blocks", "no requests yet: run one")
    grid = block_states(reqs, block_size)
    names = ("hit", "miss", "evicted")
    counts = {k: sum(v == i for row in grid for v in row) for i, k in enumerate(names)}
    labels = [f"#{r['request']}" for r in reqs]
    text = [[("" if v is None else f"request {labels[r]} · block {b} · tokens "
              f"{b * block_size}:{min(reqs[r]['prompt'], (b + 1) * block_size)} · {names[v]}")
             for b, v in enumerate(row)] for r, row in enumerate(grid)]
    fig = go.Figure(go.Heatmap(
        z=grid, x=list(range(len(grid[0]) if grid else 0)), y=labels, text=text,
        hovertemplate="%{text}<extra></extra>", zmin=-0.5, zmax=2.5, xgap=1, ygap=1,
        colorscale=_discrete([COLORS[k] for k in names]),
        colorbar=dict(tickvals=[0, 1, 2], ticktext=["hit", "miss", "evicted"], thickness=10)))
    fig.update_layout(
        title=f"{block_size}-token blocks · {counts['hit']} hit · {counts['miss']} miss · "
              f"{counts['evicted']} recomputed after eviction",
        xaxis_title="block", yaxis=dict(title="request", autorange="reversed", type="category"),
        height=max(220, 60 + 22 * len(reqs)), margin=dict(t=40, l=60, r=10, b=40),
        meta={"counts": counts, "block_size": block_size})
    return fig


# ----------------------------------------------------------------------------- hit-ratio curves

def hit_ratio_curves(sweeps, metric: str = "token_hit_ratio", *, x: str = "capacity_tokens",
                     title: str | None = None) -> go.Figure:
    """Hit ratio against capacity, one line per policy (``metric="both"``: token ratio solid,
    request ratio dashed).

    ``sweeps``: ``{policy: kv.sweep(...) frame}`` or one frame with a ``policy`` column.

    Example:
        >>> caps = [2**k for k in range(10, 20)]
        >>> kv.viz.hit_ratio_curves({p: kv.sweep(trace, p, caps) for p in ("lru", "fifo", "lfu")})
    """
    metrics = ("token_hit_ratio", "request_hit_ratio") if metric == "both" else (metric,)
    if isinstance(sweeps, dict):
        items = [(str(k), _frame(v, f"sweeps[{k!r}]")) for k, v in sweeps.items()]
    else:
        f = _frame(sweeps, "hit_ratio_curves' sweeps")
        if "policy" not in f.columns:
            raise VizError("hit_ratio_curves takes {policy: frame} or one frame with a 'policy' "
                           f"column; this frame has {f.columns}")
        items = [(str(g["policy"][0]), g) for g in f.partition_by("policy", maintain_order=True)]
    if not items:
        raise VizError("hit_ratio_curves got no sweeps; pass {policy: kv.sweep(...)}")
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
               "#7f7f7f", "#bcbd22", "#17becf"]
    fig = go.Figure()
    xs_all = []
    for k, (policy, f) in enumerate(items):
        _need(f, (x, *metrics), f"hit_ratio_curves ({policy})")
        f = f.filter(pl.col(x).is_not_null()).sort(x)
        xs = f[x].to_list()
        xs_all += xs
        for m in metrics:
            dash = "dash" if m == "request_hit_ratio" and len(metrics) > 1 else "solid"
            name = policy if len(metrics) == 1 else f"{policy} · {m.split('_')[0]}"
            fig.add_trace(go.Scatter(x=xs, y=f[m].to_list(), name=name, mode="lines+markers",
                                     line=dict(color=palette[k % len(palette)], dash=dash),
                                     hovertemplate=f"{html.escape(name)}<br>{x} %{{x:,}}<br>{m} "
                                                   "%{y:.1%}<extra></extra>"))
    positive = [v for v in xs_all if v and v > 0]
    log = bool(positive) and max(positive) / min(positive) >= 100
    fig.update_layout(title=title or f"{' and '.join(metrics)} against {x}",
                      xaxis=dict(title=x, type="log" if log else "linear"),
                      yaxis=dict(title=metrics[0] if len(metrics) == 1 else "hit ratio",
                                 tickformat=".0%", range=[0, 1.02]),
                      height=360, margin=dict(t=40, l=60, r=10, b=40))
    return fig
