"""A SharedRadixStore node (an edge of symbols and the KV of exactly those tokens) and the frames
and HTML that show a tree of them.

Example:
    >>> frame_of(store.root).columns[:4]
    ['id', 'parent', 'start', 'depth']
"""

from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl

from ..primitives.snapshots import Snapshot
from ..primitives.display import summary_html, table_html


@dataclass(eq=False)
class Node:
    """One node: ``edge`` (symbols of tokens [depth - len(edge), depth)), ``kv`` (a snapshot of
    exactly those tokens; None at the root), ``ends`` (positions in (start, depth] where an insert
    ended and no later insert extended it: what match kinds call an entry), ``lock`` (inserts in
    flight whose path runs through it: it cannot be evicted)."""

    id: int
    edge: tuple
    parent: "Node | None"
    depth: int
    kv: Snapshot | None
    kind: str
    children: dict = field(default_factory=dict)
    ends: set = field(default_factory=set)
    lock: int = 0
    hits: int = 0
    last_used: int = 0

    @property
    def nbytes(self) -> int:
        return 0 if self.kv is None else self.kv.nbytes

    @property
    def start(self) -> int:
        return self.depth - len(self.edge)

    @property
    def tokens(self) -> int:
        return len(self.edge)

    def walk(self):
        yield self
        for child in self.children.values():
            yield from child.walk()

    def __repr__(self) -> str:
        return f"Node({self.id}, tokens [{self.start}, {self.depth}), {self.nbytes} B, {len(self.children)} children)"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


def edge_ids(edge: tuple) -> list[int]:
    """Token ids of an edge's symbols (a symbol is an id, or (id, namespace tag))."""
    return [s if isinstance(s, int) else s[0] for s in edge]


def frame_of(root: Node) -> pl.DataFrame:
    """One row per node, with RadixStore.tree_frame's columns (``entry`` is the node's own id:
    every node but the root holds KV)."""
    rows = []
    for n in root.walk():
        own = n is not root
        rows.append({"id": n.id, "parent": None if n.parent is None else n.parent.id,
                     "start": n.start, "depth": n.depth, "tokens": n.tokens, "edge_ids": edge_ids(n.edge),
                     "entry": n.id if own else None, "entry_kind": n.kind if own else None,
                     "hits": n.hits, "last_used": n.last_used, "bytes": n.nbytes})
    return pl.DataFrame(rows, schema_overrides={"parent": pl.Int64, "entry": pl.Int64,
                                                "edge_ids": pl.List(pl.Int64)})


def html_of(store, note: str = "") -> str:
    """A store's _repr_html_: its summary line and its first 50 nodes."""
    frame = frame_of(store.root).drop("edge_ids")
    return summary_html("SharedRadixStore", f"{store.entries} nodes",
                        f"{store.nbytes / 2**20:.2f} MiB of {store.budget_bytes / 2**20:.0f} MiB",
                        f"{store.evictions} evictions", f"policy {store.policy.name}", note=note,
                        body=table_html(frame.columns, frame.head(50).rows(), total=frame.height))
