"""Requests x blocks: which prompt blocks each request reused, computed fresh, or recomputed
after an eviction.

Example:
    >>> kv.viz.block_grid(engine, block_size=16).layout.meta["counts"]
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
import polars as pl

from ..errors import VizError
from .common import COLORS, as_frame, discrete, empty


def request_rows(x) -> list[dict]:
    """One dict per request (request, prompt, reused, ids) from an Engine, Results or a frame."""
    if hasattr(x, "results") and not isinstance(x, pl.DataFrame):
        x = x.results
    if isinstance(x, (list, tuple)) and all(hasattr(r, "prompt_ids") for r in x):
        return [{"request": r.request_id, "prompt": r.prompt_tokens, "reused": r.reused_tokens,
                 "ids": tuple(r.prompt_ids) or None} for r in x]
    f = as_frame(x, "block_grid's input")
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
    reqs = request_rows(engine_or_frames)
    if not reqs:
        return empty("blocks", "no requests yet: run one")
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
        colorscale=discrete([COLORS[k] for k in names]),
        colorbar=dict(tickvals=[0, 1, 2], ticktext=["hit", "miss", "evicted"], thickness=10)))
    fig.update_layout(
        title=f"{block_size}-token blocks · {counts['hit']} hit · {counts['miss']} miss · "
              f"{counts['evicted']} recomputed after eviction",
        xaxis_title="block", yaxis=dict(title="request", autorange="reversed", type="category"),
        height=max(220, 60 + 22 * len(reqs)), margin=dict(t=40, l=60, r=10, b=40),
        meta={"counts": counts, "block_size": block_size})
    return fig
