"""The store's prefix tree as an icicle (RadixStore nodes, or PagedStore's block chains).

Example:
    >>> fig = kv.viz.prefix_tree(engine.store, m.tokenizer, color="recency")
"""

from __future__ import annotations

import plotly.graph_objects as go
import polars as pl

from ..errors import VizError
from ..engine import Engine
from ..primitives.tokens import hf_tokenizer
from ..stores.base import Store
from .common import as_frame, empty, need, tokenizer_from, visible

NEVER_HIT = "#e6e6e6"  # grey: a node no lookup reused; any hit is blue, darker with more
HITS_SCALE = [[0.0, NEVER_HIT], [1e-6, "#c6dbef"], [1.0, "#08306b"]]


def _tree_frame(x) -> pl.DataFrame:
    if isinstance(x, pl.DataFrame):
        return as_frame(x, "prefix_tree's input")
    store = x.store if isinstance(x, Engine) else x
    if isinstance(store, Store):
        views = store.capabilities.views
        for view in ("tree", "blocks"):
            if view in views:
                return store.frame(view)
    raise VizError(f"prefix_tree takes a store whose capabilities list a tree or blocks view (its "
                   f"tree_frame or blocks_frame: RadixStore, PagedStore, SharedRadixStore), an Engine, "
                   f"or the tree frame itself; got {type(x).__name__}")


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
    subtree's), colour = hits (``NEVER_HIT`` grey for a node no lookup reused, blue darker with
    more) or recency, hover = the node's decoded text, bytes and last use.

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
    need(frame, ("id", "parent", "tokens"), "prefix_tree")
    tok = tokenizer_from(tokenizer)
    n = frame.height
    if n == 0:
        return empty("prefix tree", "the store is empty: run a request")

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
    hf = hf_tokenizer(tok) if tok is not None else None
    texts = [None if e is None or hf is None else hf.decode([int(t) for t in e]) for e in edges]
    labels = []
    for i in range(n):
        if tokens[i] == 0 and parents[i] in ("", "root") and not synthetic:
            labels.append("root")
        elif texts[i] is not None:
            labels.append(visible(texts[i], label_chars) or "∅")
        else:
            labels.append(f"#{node_ids[i]} · {tokens[i]} tok")
    hover = [visible(t, hover_chars) if t is not None else "" for t in texts]
    custom = [[hover[i], int(nbytes[i] or 0), last[i], hits[i], tokens[i],
               "" if start[i] is None else start[i], "" if depth[i] is None else depth[i],
               "—" if entry[i] is None else entry[i]] for i in range(n)]
    values = list(tokens)
    shade = hits if color == "hits" else last
    if synthetic:
        node_ids.append("root"), parents.append(""), labels.append("root"), values.append(0)
        custom.append(["", 0, 0, 0, 0, "", "", "—"]), shade.append(0)
    # hits: 0 is grey whatever the most-hit node has, so "never reused" reads at a glance
    scale = (dict(colorscale=HITS_SCALE, cmin=0, cmax=max(max(shade), 1)) if color == "hits"
             else dict(colorscale="Viridis"))
    fig = go.Figure(go.Icicle(
        ids=node_ids, parents=parents, labels=labels, values=values, branchvalues="remainder",
        customdata=custom, marker=dict(colors=shade, showscale=True, colorbar=dict(title=color, thickness=12),
                                       **scale),
        hovertemplate=("<b>%{label}</b><br>%{customdata[4]} tokens [%{customdata[5]}, %{customdata[6]})"
                       "<br>%{customdata[1]:,} bytes · entry %{customdata[7]}"
                       "<br>hits %{customdata[3]} · last use %{customdata[2]}"
                       "<br><span style='font-family:monospace'>%{customdata[0]}</span><extra></extra>"),
        tiling=dict(orientation="v"), root=dict(color="#eeeeee"), sort=False))
    fig.update_layout(title=f"prefix tree · {n} nodes · {sum(tokens)} tokens · colour = {color}",
                      margin=dict(t=40, l=10, r=10, b=10), height=420)
    return fig
