"""A paged store's block chains read as a prefix tree: runs of blocks that never branch become one
node, so the frame has RadixStore.tree_frame's shape and columns for the same traffic (token
spans rounded down to whole blocks, as only full blocks are cached).

A run starts at a block whose parent is not resident (a root; its start is unknown unless the
parent is simply absent because the block is the first) or whose parent has other children, and
goes on while the block has exactly one resident child. Its ``hits`` are its first block's (a
lookup reusing any block of a chain reused every block before it), ``last_used`` the latest of its
blocks' and ``bytes`` their sum. Row 0 is a token-less root, as in a radix tree.

Example:
    >>> tree_of(store.blocks_frame()).columns[:5]
    ['id', 'parent', 'start', 'depth', 'tokens']
"""

from __future__ import annotations

import polars as pl

SCHEMA = {"id": pl.Int64, "parent": pl.Int64, "start": pl.Int64, "depth": pl.Int64, "tokens": pl.Int64,
          "edge_ids": pl.List(pl.Int64), "entry": pl.Int64, "entry_kind": pl.Utf8, "hits": pl.Int64,
          "last_used": pl.Int64, "bytes": pl.Int64, "blocks": pl.Int64}


def tree_of(blocks: pl.DataFrame) -> pl.DataFrame:
    """``blocks`` (PagedStore.blocks_frame(): block, hash, parent, token_ids, bytes, hits,
    last_used) as one row per run of blocks (module docstring), depth-first from the root."""
    rows = list(blocks.iter_rows(named=True))
    by_hash = {r["hash"]: r for r in rows}
    children: dict = {}
    for r in rows:
        children.setdefault(r["parent"] if r["parent"] in by_hash else None, []).append(r)
    # a chain whose parent is gone (evicted) starts at an unknown position; a first block at 0
    out = [{"id": 0, "parent": None, "start": 0, "depth": 0, "tokens": 0, "edge_ids": [], "entry": None,
            "entry_kind": None, "hits": 0, "last_used": 0, "bytes": 0, "blocks": 0}]
    stack = [(r, 0, 0 if r["parent"] is None else None) for r in reversed(children.get(None, []))]
    while stack:
        first, parent, start = stack.pop()
        run = [first]
        while len(kids := children.get(run[-1]["hash"], [])) == 1:
            run.append(kids[0])
        ids = [t for b in run for t in b["token_ids"]]
        depth = None if start is None else start + len(ids)
        out.append({"id": first["block"], "parent": parent, "start": start, "depth": depth,
                    "tokens": len(ids), "edge_ids": ids, "entry": None, "entry_kind": None,
                    "hits": max(b["hits"] for b in run), "last_used": max(b["last_used"] for b in run),
                    "bytes": sum(b["bytes"] for b in run), "blocks": len(run)})
        stack.extend((k, first["block"], depth) for k in reversed(kids))
    return pl.DataFrame(out, schema=SCHEMA)
